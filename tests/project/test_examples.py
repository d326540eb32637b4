"""Every ``examples/*.py`` script runs against a private server and its invariant holds.

Scripts are found by glob, so a new example is covered as soon as it exists. Each runs as a real
subprocess (``sys.executable``) with ``KEYSERIAL_REDIS_URL`` pointing at the test server, while an
in-process worker serves the namespace the scripts use (``"default"`` with 16 shards; no other
test uses it, they all take a unique namespace) with exactly the ``--app`` modules that
examples/README.md's worker command for that script names.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import anyio
import pytest

from keyserial.testing import running_worker
from tests.helpers import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("[0-9]*.py"))
#: Examples that also need a PostgreSQL database (``$MAIL_PG_DSN``).
NEEDS_POSTGRES = {"06_send_once_postgres.py"}
#: The line each known example must print; any other example must end with a line "OK: ...".
EXPECTED = {
    "01_wallet.py": "OK: final balance 50; no lost update, no overdraft",
    "02_stock_counter.py": "OK: sold exactly 50, no oversell",
    "03_online_counter.py": "OK: the counter is exact (200 online) and never goes below zero",
    "04_send_once.py": "OK: each order's e-mail was sent exactly once",
    "05_no_lock_manager.py": "OK: money conserved, none negative across 3 shards",
    "06_send_once_postgres.py": "OK: one send recorded in PostgreSQL; the stale fence was refused",
}


README = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")


def worker_apps(script: str) -> list[str]:
    """The ``--app`` modules of the worker command examples/README.md gives for ``script``."""
    row = r"^\| \[`([^`]+)`\]\([^)]*\) \| `([^`]*keyserial dev[^`]*)`"
    commands = dict(re.findall(row, README, re.M))
    assert script in commands, f"examples/README.md gives no worker command for {script}"
    return re.findall(r"--app (\S+)", commands[script])


def test_every_example_is_found_and_says_how_to_run_it() -> None:
    assert {path.name for path in EXAMPLES} >= set(EXPECTED)
    for path in EXAMPLES:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        run_lines = [line for line in docstring.splitlines() if line.startswith("Run:")]
        assert run_lines, f"{path.name} has no 'Run:' line in its docstring"
        assert f"python -m examples.{path.stem}" in docstring, f"{path.name}: Run: names another"
    missing = [path.name for path in EXAMPLES if path.name not in README]
    assert not missing, f"examples/README.md does not list {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[path.stem for path in EXAMPLES])
async def test_example_runs_and_its_invariant_holds(
    script: Path,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    # The worker (in this process) and the script (a child) must share the mail outbox.
    monkeypatch.setenv("MAIL_OUTBOX", str(tmp_path / "outbox.jsonl"))
    if script.name in NEEDS_POSTGRES:  # (skips, saying why, without PostgreSQL binaries)
        monkeypatch.setenv("MAIL_PG_DSN", request.getfixturevalue("postgres_dsn"))
    # As a user's shell runs it: the tests' own PYTHONPATH (the repository root) left out.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env.update(KEYSERIAL_REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    # Served by exactly the apps examples/README.md's worker command names for the script.
    async with running_worker(redis_url, "default", shard_count=16, apps=worker_apps(script.name)):
        with anyio.fail_after(60):
            result = await anyio.run_process(
                [sys.executable, "-m", f"examples.{script.stem}"], cwd=ROOT, env=env, check=False
            )
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    report = f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    assert result.returncode == 0, report
    lines = stdout.strip().splitlines()
    assert lines and lines[-1].startswith("OK: "), report
    assert EXPECTED.get(script.name, "OK: ") in lines[-1], report
