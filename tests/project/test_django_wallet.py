"""examples/django_wallet: Django views charge wallets through ``connect_sync``, tested with
Django's test client against a real ``python -m keyserial worker --app wallet.ops`` process
started from the example's directory, as examples/README.md tells users to run it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from keyserial import shard_for
from keyserial.testing import ShardKeys
from tests.helpers import ROOT, lease_holder

# A worker process per test, and Django's set-up.
pytestmark = pytest.mark.slow

django = pytest.importorskip("django", reason="the Django example needs Django (dev extras)")

EXAMPLE = ROOT / "examples" / "django_wallet"
SHARDS = 16


@pytest.fixture
def wallet_site(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> Iterator[Any]:
    """Django configured with the example's settings, pointed at this test's server and
    namespace, and a worker process serving the example's ops; yields Django's test client."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "wallet_site.settings")
    django.setup()
    from django.test import Client, override_settings
    from wallet.client import close_client

    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyserial",
            "worker",
            "--app",
            "wallet.ops",
            "--redis",
            redis_url,
            "--namespace",
            namespace,
            "--shard-count",
            str(SHARDS),
        ],
        cwd=EXAMPLE,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 30
        while not all(lease_holder(redis_url, namespace, s) for s in range(SHARDS)):
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker did not take its shards"
            time.sleep(0.05)
        with override_settings(KEYSERIAL_URL=redis_url, KEYSERIAL_NAMESPACE=namespace):
            try:
                yield Client()
            finally:
                close_client()
    finally:
        worker.kill()
        worker.wait()
        log.close()


def _post(client: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = client.post(path, json.dumps(body), content_type="application/json")
    return response.status_code, response.json()


def test_concurrent_charges_through_django_never_overdraw_the_wallet(wallet_site: Any) -> None:
    assert _post(wallet_site, "/wallets/ada/top-up", {"amount": 100}) == (
        200,
        {"user": "ada", "balance": 100},
    )

    def charge(order: int) -> int:
        status, _ = _post(
            wallet_site, "/wallets/ada/charge", {"amount": 30, "order_id": f"ada-{order}"}
        )
        return status

    with ThreadPoolExecutor(max_workers=10) as pool:  # ten requests at once, on ten threads
        statuses = sorted(pool.map(charge, range(10)))
    assert statuses == [200] * 3 + [402] * 7
    assert wallet_site.get("/wallets/ada").json() == {"user": "ada", "balance": 10}


def test_a_retried_charge_request_charges_the_wallet_once(wallet_site: Any) -> None:
    _post(wallet_site, "/wallets/bob/top-up", {"amount": 50})
    first = _post(wallet_site, "/wallets/bob/charge", {"amount": 20, "order_id": "bob-1"})
    retried = _post(wallet_site, "/wallets/bob/charge", {"amount": 20, "order_id": "bob-1"})
    assert first == retried == (200, {"user": "bob", "balance": 30})
    assert wallet_site.get("/wallets/bob").json()["balance"] == 30
    status, refused = _post(wallet_site, "/wallets/bob/charge", {"amount": 99, "order_id": "b-2"})
    assert (status, refused["balance"]) == (402, 30)


def test_bad_requests_get_a_400_and_an_order_id_reused_for_another_amount_a_409(
    wallet_site: Any,
) -> None:
    _post(wallet_site, "/wallets/di/top-up", {"amount": 50})
    for path, body in (
        ("/wallets/di/top-up", {"amount": -5}),
        ("/wallets/di/top-up", {"amount": "ten"}),
        ("/wallets/di/top-up", {}),
        ("/wallets/di/charge", {"amount": 0, "order_id": "di-1"}),
        ("/wallets/di/charge", {"amount": 5}),
    ):
        status, answer = _post(wallet_site, path, body)
        assert status == 400, (path, body, answer)
    response = wallet_site.post("/wallets/di/top-up", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert _post(wallet_site, "/wallets/di/charge", {"amount": 5, "order_id": "di-2"})[0] == 200
    status, answer = _post(wallet_site, "/wallets/di/charge", {"amount": 6, "order_id": "di-2"})
    assert status == 409 and "belongs to another op" in answer["error"]
    assert wallet_site.get("/wallets/di").json()["balance"] == 45


def test_the_wallets_live_in_the_namespace_the_settings_name(
    wallet_site: Any, redis_url: str, namespace: str
) -> None:
    _post(wallet_site, "/wallets/cy/top-up", {"amount": 5})
    client = redis.Redis.from_url(redis_url)
    try:
        state = ShardKeys(namespace, shard_for("wallet:cy", SHARDS)).state
        assert client.hget(state, "wallet:cy") == b"5"
    finally:
        client.close()
