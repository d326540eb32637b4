"""examples/fastapi_wallet through FastAPI's test client, against a real worker (the pytest
plugin's): deposits, balances, idempotent transfers, and bad input answered with 4xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from examples.fastapi_wallet.app import app
from keyserial.pytest_plugin import KeyserialWorker


@pytest.fixture
def http(
    keyserial_worker: KeyserialWorker, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    monkeypatch.setenv("KEYSERIAL_REDIS_URL", keyserial_worker.url)
    monkeypatch.setenv("KEYSERIAL_NAMESPACE", keyserial_worker.namespace)
    with TestClient(app) as client:
        yield client


def test_deposits_transfers_and_balances(http: TestClient) -> None:
    assert http.post("/accounts/alice/deposit", json={"amount": 100}).json() == {"alice": 100}
    transfer = {"source": "alice", "target": "bob", "amount": 30, "transfer_id": "t-1"}
    assert http.post("/transfers", json=transfer).json() == {"alice": 70, "bob": 30}
    # Sent again (a retry): the first outcome, nothing moved twice.
    assert http.post("/transfers", json=transfer).json() == {"alice": 70, "bob": 30}
    assert http.get("/accounts/alice").json() == {"alice": 70}
    assert http.get("/accounts/bob").json() == {"bob": 30}


def test_a_transfer_over_the_balance_is_a_conflict_and_moves_nothing(http: TestClient) -> None:
    http.post("/accounts/carol/deposit", json={"amount": 10})
    response = http.post("/transfers", json={"source": "carol", "target": "dan", "amount": 11})
    assert response.status_code == 409
    assert "less than 11" in response.json()["error"]
    assert http.get("/accounts/carol").json() == {"carol": 10}


def test_a_transfer_id_reused_for_another_transfer_is_a_conflict(http: TestClient) -> None:
    http.post("/accounts/erin/deposit", json={"amount": 10})
    first = {"source": "erin", "target": "fay", "amount": 1, "transfer_id": "t-2"}
    assert http.post("/transfers", json=first).status_code == 200
    response = http.post("/transfers", json={**first, "amount": 2})
    assert response.status_code == 409
    assert http.get("/accounts/erin").json() == {"erin": 9}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/accounts/gus/deposit", {"amount": -5}),
        ("/accounts/gus/deposit", {"amount": "ten"}),
        ("/accounts/gus/deposit", {}),
        ("/transfers", {"source": "gus", "target": "gus", "amount": 1}),
        ("/transfers", {"source": "gus", "target": "hal", "amount": 1, "transfer_id": "a#b"}),
    ],
)
def test_bad_input_gets_a_400_saying_what_is_wrong(
    http: TestClient, path: str, body: dict[str, object]
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]
