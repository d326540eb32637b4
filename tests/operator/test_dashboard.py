"""``keyserial dashboard``, served by the real command and driven in a real headless Chromium
(Debian's ``chromium`` and ``chromium-driver``; ``.ci/run`` installs them): the page loads the
shards and workers, its numbers follow the load, a dead letter is replayed and dropped from it,
the key inspector shows a failed op's traceback, a pause from the page holds the key, and markup
in a key shows as text. The API answers only to the token: every route of the app's route
table that may change something is refused without it, and changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio

import keyserial
from keyserial._worker.activity import RECENT_OPS
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests import apps
from tests.helpers import ROOT, Starter, eventually

# A real Chromium per test.
pytestmark = pytest.mark.slow

SHARDS = 4
TOKEN = "test-token-123"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: A key a hostile client may write: were it put into the page as HTML, it would run script.
MARKUP_KEY = "<img src=x onerror=\"document.title='pwned'\">"


@contextmanager
def dashboard(url: str, namespace: str) -> Iterator[str]:
    """``keyserial dashboard`` on a free port; the URL it prints (with the token)."""
    command = [sys.executable, "-m", "keyserial", "dashboard", "--redis", url]
    process = subprocess.Popen(
        [*command, "--namespace", namespace, "--port", "0", "--token", TOKEN],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "http://127.0.0.1:" in line, process.stderr.read() if process.stderr else line
        yield line.split()[-1]
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium under Selenium, with Debian's driver (never a downloaded one)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (.ci/run)")
        pytest.skip("needs Debian's chromium and chromium-driver (apt install them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1300,1400",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def on_page(check: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """``check``, a call into the browser, as a check for ``eventually``: run in a thread, and
    not yet true where a refresh replaced a page element it held (looked up again next time)."""
    from selenium.common.exceptions import StaleElementReferenceException

    async def in_a_thread() -> Any:
        try:
            return await anyio.to_thread.run_sync(check)
        except StaleElementReferenceException:
            return None

    return in_a_thread


#: The cells' text of a table's body rows, read in the page in one call: cell by cell, each a
#: round trip to the browser, a loaded machine took longer than the page's one-second refresh,
#: and every read met a row the refresh had replaced.
_ROWS = """
return Array.from(document.querySelectorAll(arguments[0]), (row) =>
  Array.from(row.querySelectorAll("td"), (cell) => cell.innerText.trim()));
"""


def rows(driver: Any, table: str) -> list[list[str]]:
    """The cells' text of a table's body rows."""
    found: list[list[str]] = driver.execute_script(_ROWS, f"#{table} tbody tr")
    return found


def click_in_row(driver: Any, table: str, row_text: str, label: str) -> bool:
    """Click the button ``label`` of the row of ``table`` that shows ``row_text``."""
    from selenium.webdriver.common.by import By

    for row in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr"):
        if row_text in row.text:
            row.find_element(By.XPATH, f".//button[text()={json.dumps(label)}]").click()
            return True
    return False


@asynccontextmanager
async def served(url: str, namespace: str) -> AsyncIterator[keyserial.Client]:
    async with (
        running_worker(url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(url, namespace=namespace) as ks,
    ):
        yield ks


async def dead_letter(url: str, namespace: str, op_id: str, key: str) -> int:
    """Append ``record`` on ``key`` as a client that wrote the entry wrong (one envelope, not
    an array of them): the worker dead-letters it whole, and it never ran. Its shard."""
    shard = keyserial.shard_for(key, SHARDS)
    keys = ShardKeys(namespace, shard)
    client = redis.asyncio.Redis.from_url(url)
    try:
        ops = json.dumps({"id": op_id, "key": key, "op": "record"})
        entry = await client.xadd(keys.stream, {"v": "1", "ops": ops})
        await client.publish(keys.wake_channel, entry)
        with anyio.fail_after(10):
            while not await client.xlen(keys.dead):
                await anyio.sleep(0.05)
    finally:
        await client.aclose()
    return shard


async def test_the_page_shows_updates_and_acts(
    standalone_server: LocalServer, namespace: str, browser: Any, start: Starter
) -> None:
    from selenium.webdriver.common.by import By

    url = standalone_server.url
    reached_the_end = False
    async with served(url, namespace) as ks:
        await ks.submit("warm:up", deposit(1))
        standby = start(url, namespace, shards="0-3", shard_count=SHARDS)
        with dashboard(url, namespace) as page:
            await anyio.to_thread.run_sync(browser.get, page)
            # It loads: every shard, owned by this process's worker.
            owners = await eventually(
                on_page(lambda: [row[1] for row in rows(browser, "shards")]),
                timeout=15,
                interval=0.1,
            )
            this_worker = f"{os.uname().nodename}:{os.getpid()}"
            assert owners == [this_worker] * SHARDS
            workers = await eventually(
                on_page(lambda: len(rows(browser, "workers")) == 2 and rows(browser, "workers")),
                timeout=15,
                interval=0.1,
            )
            by_worker = {row[0]: row[1:3] for row in workers}
            assert by_worker == {
                this_worker: ["0, 1, 2, 3", "-"],
                f"{os.uname().nodename}:{standby.pid}": ["-", "0, 1, 2, 3"],
            }

            # Its numbers follow the load: a key that gets ops becomes the hottest.
            async def keep_depositing() -> None:
                while True:
                    await ks.submit("hot:1", deposit(1))

            async with anyio.create_task_group() as load:
                load.start_soon(keep_depositing)
                hot = await eventually(
                    on_page(lambda: [r for r in rows(browser, "hot") if r[0] == "hot:1"]),
                    timeout=15,
                    interval=0.1,
                )
                assert float(hot[0][1]) > 0
                busy = await eventually(
                    on_page(
                        lambda: [r for r in rows(browser, "shards") if r[7] not in ("-", "0.0")]
                    ),
                    timeout=15,
                    interval=0.1,
                )
                assert busy[0][0] == str(keyserial.shard_for("hot:1", SHARDS))
                load.cancel_scope.cancel()

            # A dead letter, replayed from the page, runs its op once; then it is dropped.
            shard = await dead_letter(url, namespace, "lost-op-1", "replayed:1")
            await eventually(
                on_page(lambda: click_summary(browser, "letters", "lost-op-1")),
                timeout=15,
                interval=0.1,
            )
            shown_raw = await eventually(
                on_page(lambda: browser.find_element(By.CSS_SELECTOR, "#letters pre").text),
                timeout=15,
                interval=0.1,
            )
            written = {"id": "lost-op-1", "key": "replayed:1", "op": "record"}
            assert json.loads(json.loads(shown_raw)["ops"]) == written  # the entry, as it was
            await eventually(
                on_page(lambda: click_in_row(browser, "letters", "lost-op-1", "Replay")),
                timeout=15,
                interval=0.1,
            )
            message = await eventually(
                on_page(lambda: browser.find_element(By.ID, "message").text),
                timeout=15,
                interval=0.1,
            )
            assert "replayed dead letter" in message and "lost-op-1" in message
            assert await ks.result("lost-op-1", key="replayed:1") == 1
            assert await ks.read("replayed:1") == ["lost-op-1"]
            await eventually(
                on_page(lambda: click_in_row(browser, "letters", "lost-op-1", "Drop")),
                timeout=15,
                interval=0.1,
            )
            await anyio.to_thread.run_sync(lambda: browser.switch_to.alert.accept())
            assert await eventually(
                on_page(lambda: not rows(browser, "letters")), timeout=15, interval=0.1
            )
            assert await ks.read("replayed:1") == ["lost-op-1"]  # (dropping runs nothing)
            assert shard in range(SHARDS)

            # The key inspector: a failed op's error and traceback, and a pause.
            with pytest.raises(keyserial.OperationFailed):
                await ks.submit("broken:1", apps.fail_deep(2))
            # (Workers post their recent ops every 2 s: Inspect again until it is there.)
            outcome = await eventually(
                on_page(
                    lambda: (
                        inspect_key(browser, "broken:1")
                        or [r[3] for r in rows(browser, "key-recent") if "fail_deep" in r]
                    )
                ),
                timeout=15,
                interval=0.1,
            )
            assert outcome == ["RuntimeError: boom at the bottom of broken:1"]
            # (The last Inspect's answer may still replace the rows: open and read at once.)
            trace = await eventually(
                on_page(lambda: open_traceback(browser, "key-recent")), timeout=15, interval=0.1
            )
            assert "Traceback" in trace and "fail_deep" in trace
            failed = await eventually(
                on_page(lambda: [r for r in rows(browser, "failed") if "broken:1" in r]),
                timeout=15,
                interval=0.1,
            )
            assert failed[0][2:4] == ["fail_deep", "RuntimeError"]
            browser.find_element(By.ID, "key-pause").click()
            await eventually(
                on_page(lambda: browser.find_element(By.ID, "key-pause").text == "Resume"),
                timeout=15,
                interval=0.1,
            )
            assert "paused" in browser.find_element(By.ID, "key-paused").text
            with pytest.raises(keyserial.SubmitTimeout):
                await ks.submit("broken:1", deposit(5), timeout=1)  # queued, not run
            browser.find_element(By.ID, "key-pause").click()
            await eventually(
                on_page(lambda: browser.find_element(By.ID, "key-pause").text == "Pause"),
                timeout=15,
                interval=0.1,
            )
            with anyio.fail_after(10):
                while await ks.read("broken:1") != 5:  # the queued op ran once resumed
                    await anyio.sleep(0.05)

            # Markup in a key is shown as text, never run.
            await ks.submit(MARKUP_KEY, deposit(1))
            shown = await eventually(
                on_page(lambda: [r for r in rows(browser, "hot") if r[0] == MARKUP_KEY]),
                timeout=15,
                interval=0.1,
            )
            assert shown
            assert browser.title == "keyserial dashboard"
            assert not browser.find_elements(By.CSS_SELECTOR, "#hot img")
        reached_the_end = True
    assert reached_the_end


def click_summary(driver: Any, table: str, text: str) -> bool:
    """Open the ``<details>`` of ``table`` whose summary shows ``text``."""
    from selenium.webdriver.common.by import By

    for summary in driver.find_elements(By.CSS_SELECTOR, f"#{table} summary"):
        if text in summary.text:
            summary.click()
            return True
    return False


def open_traceback(browser: Any, table: str) -> str:
    """Open the first failed op's traceback in ``table``, and the text it shows."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, f"#{table} summary").click()
    return str(browser.find_element(By.CSS_SELECTOR, f"#{table} pre").text)


def inspect_key(browser: Any, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, "key-input")
    field.clear()
    field.send_keys(key)
    browser.find_element(By.ID, "key-go").click()


#: The methods by which a request may change something: every route that takes one of them
#: must answer only to the token.
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: A dead letter's op, and the keys the refused requests aim at.
LOST_OP, LOST_KEY, HELD_KEY, RUNNING_KEY = "lost-op-1", "lost:1", "held:1", "account:1"


def guarded_routes() -> list[tuple[str, str]]:
    """From the app's own route table: each ``(method, path format)`` that must answer only to
    the token: every route under ``/api/``, and every route anywhere that takes a method that
    may change something. A route added later is in it without a change here."""
    from starlette.routing import Mount, Route

    from keyserial._dashboard.app import create_app

    app = create_app("redis://unused", "unused", TOKEN, max_backlog=1)
    found = []
    routes: list[tuple[str, Any]] = [("", route) for route in app.routes]
    while routes:
        prefix, route = routes.pop(0)
        if isinstance(route, Mount):
            routes += [(prefix + route.path, inner) for inner in route.routes]
            continue
        assert isinstance(route, Route), f"a route of a kind this test cannot read: {route!r}"
        path = prefix + route.path_format
        methods = set(route.methods or ())
        if path.startswith("/api/") or methods & MUTATING:
            found += [(method, path) for method in sorted(methods - {"HEAD"})]
    return found


def filled(path: str, candidates: dict[str, list[str]]) -> list[str]:
    """``path`` with each of its parameters given each of its candidate values."""
    names = [part.partition("}")[0] for part in path.split("{")[1:]]
    unknown = set(names) - set(candidates)
    assert not unknown, f"{path}: give this test values for {sorted(unknown)}"
    paths = [path]
    for name in names:
        paths = [p.replace(f"{{{name}}}", value, 1) for p in paths for value in candidates[name]]
    return paths


async def test_the_api_answers_only_to_the_token(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    guarded = guarded_routes()
    mutating = {path for method, path in guarded if method in MUTATING}
    assert {
        "/api/keys/{key}/pause",
        "/api/keys/{key}/resume",
        "/api/dead-letters/{shard}/{letter}/replay",
        "/api/dead-letters/{shard}/{letter}/drop",
    } <= mutating, mutating  # (the route table was read: at least these are in it)
    async with served(url, namespace) as ks:
        await ks.submit(RUNNING_KEY, deposit(7))
        shard = await dead_letter(url, namespace, LOST_OP, LOST_KEY)
        with dashboard(url, namespace) as page:
            base = page.partition("#")[0].rstrip("/")
            authorized = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base) as http:

                async def state() -> dict[str, Any]:
                    """What a refused request must leave as it was."""
                    overview = (await http.get("/api/overview", headers=authorized)).json()
                    keys = {}
                    for key in (RUNNING_KEY, HELD_KEY, LOST_KEY):
                        shown = await http.get(f"/api/keys/{key}", headers=authorized)
                        keys[key] = {k: shown.json()[k] for k in ("state", "paused")}
                    return {"letters": overview["dead_letters"], "keys": keys}

                assert (await http.get("/")).status_code == 200  # (the page holds no data)
                held = await http.post(f"/api/keys/{HELD_KEY}/pause", headers=authorized)
                assert held.status_code == 200, held.text
                before = await state()
                [letter] = before["letters"]
                assert letter["op_ids"] == [LOST_OP] and letter["shard"] == shard
                assert before["keys"] == {
                    RUNNING_KEY: {"state": "7", "paused": False},
                    HELD_KEY: {"state": None, "paused": True},
                    LOST_KEY: {"state": None, "paused": False},  # (its op never ran)
                }
                candidates = {
                    "key": [RUNNING_KEY, HELD_KEY],  # (one to pause, one to resume)
                    "shard": [str(shard)],
                    "letter": [letter["id"]],
                }
                refused = 0
                for wrong in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                    for method, route in guarded:
                        for path in filled(route, candidates):
                            answer = await http.request(method, path, headers=wrong)
                            assert answer.status_code == 401, (method, path, wrong, answer.text)
                            refused += 1
                assert refused >= 3 * 8
                assert await state() == before, "a refused request changed something"
                assert await ks.read(RUNNING_KEY) == 7
                missing = await http.post("/api/dead-letters/0/1-0/replay", headers=authorized)
                assert missing.status_code == 409
                assert "no dead letter" in missing.json()["error"]
                bad = await http.post("/api/dead-letters/0/nonsense/drop", headers=authorized)
                assert bad.status_code == 409
                assert "not a dead-letter id" in bad.json()["error"]
        posted = await eventually(lambda: activity_posted(url, namespace))
        assert [json.loads(post)["hot"] for post in posted.values()] == [[[RUNNING_KEY, 1]]]
    assert await activity_posted(url, namespace) == {}, "a stopped worker's post is dropped"


async def test_the_api_shows_paused_keys_roster_ages_and_failed_ops_among_a_key_s_recent(
    standalone_server: LocalServer, namespace: str
) -> None:
    """The overview counts each shard's paused keys and names them, and gives each worker's
    roster age; a key's recent ops include its failed op after the worker's last 200 ops have
    moved past it (the worker keeps its last failures longer, and the overview lists them)."""
    url = standalone_server.url
    async with served(url, namespace) as ks:
        with pytest.raises(keyserial.OperationFailed) as failed:
            await ks.submit("broken:1", apps.fail_deep(1))
        async with anyio.create_task_group() as group:  # more than the 200 ops a worker keeps
            for n in range(RECENT_OPS + 20):
                group.start_soon(ks.submit, f"filler:{n}", deposit(1))
        op_id = failed.value.op_id

        async def moved_past() -> bool:
            posts = [json.loads(raw) for raw in (await activity_posted(url, namespace)).values()]
            return any(
                op_id in [op["id"] for op in post["failed"]]
                and op_id not in [op["id"] for op in post["recent"]]
                for post in posts
            )

        await eventually(moved_past)
        with dashboard(url, namespace) as page:
            base = page.partition("#")[0].rstrip("/")
            authorized = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base, headers=authorized) as http:
                paused = await http.post(f"/api/keys/{HELD_KEY}/pause")
                assert paused.status_code == 200, paused.text
                overview = (await http.get("/api/overview")).json()
                key = (await http.get("/api/keys/broken:1")).json()
    assert [op["id"] for op in overview["failed"]] == [op_id]
    assert [(op["id"], op["outcome"]["error"]["type"]) for op in key["recent"]] == [
        (op_id, "RuntimeError")
    ]
    held_on = keyserial.shard_for(HELD_KEY, SHARDS)
    assert [(s["paused"], s["paused_keys"]) for s in overview["shards"]] == [
        (1, [HELD_KEY]) if shard == held_on else (0, []) for shard in range(SHARDS)
    ]
    (worker,) = overview["workers"]
    assert 0 <= worker["renewed_ms_ago"] < 12_000 and worker["maybe_gone"] is False


async def activity_posted(url: str, namespace: str) -> dict[bytes, bytes]:
    """What workers posted of what they ran (``ks:<ns>:activity``)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        posted: dict[bytes, bytes] = await client.hgetall(f"ks:{namespace}:activity")
    finally:
        await client.aclose()
    return posted


def run_cli(*args: str, preamble: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys\n{preamble}\nfrom keyserial.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30
    )


def test_the_command_refuses_what_it_cannot_serve(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    unused = run_cli("dashboard", "--redis", url, "--namespace", namespace, "--port", "0")
    assert unused.returncode == 2
    assert "has no shard count recorded" in unused.stderr
    without_extra = run_cli(
        "dashboard", "--redis", url, "--port", "0", preamble="sys.modules['uvicorn'] = None"
    )
    assert without_extra.returncode == 2
    assert "pip install 'keyserial[dashboard]'" in without_extra.stderr


async def test_the_api_shows_a_key_s_pending_timers_and_each_shard_s_next_one(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    async with served(url, namespace) as ks:
        timer = await ks.submit("seat:9", apps.hold_seat("carol", 900))
        later = await ks.enqueue("seat:9", deposit(1), delay=1800)
        keys = ShardKeys(namespace, ks.shard_of("seat:9"))
        client = redis.asyncio.Redis.from_url(url)
        try:
            await eventually(lambda: _count_is(client, keys.timers, 2), message="two timers")
        finally:
            await client.aclose()
        with dashboard(url, namespace) as page:
            base = page.partition("#")[0].rstrip("/")
            authorized = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base, headers=authorized) as http:
                overview = (await http.get("/api/overview")).json()
                key = (await http.get("/api/keys/seat:9")).json()
    assert [[op["id"] for op in each["ops"]] for each in key["timers"]] == [[timer], [later]]
    assert key["timers"][0]["ops"][0]["op"] == "release_seat"
    by_shard = {s["shard"]: s for s in overview["shards"]}
    assert by_shard[keys.shard]["timers"] == 2
    assert 800_000 < by_shard[keys.shard]["next_timer_in_ms"] <= 900_000


async def _count_is(client: redis.asyncio.Redis, timers: str, count: int) -> bool:
    return int(await client.zcard(timers)) == count
