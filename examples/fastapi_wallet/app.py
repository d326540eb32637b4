"""A wallet service on FastAPI: deposits, balances and transfers, with no lock anywhere.

Before keyserial, a transfer took two Redis locks (in sorted order, with a TTL and a watchdog),
read both balances, wrote both, and released: a holder paused past its TTL could write after
the next one. Here each request submits one op; keyserial runs the ops of an account one after
another, and a transfer takes both accounts' shards in a deterministic order.

Run it (the ledger's ops are built in, so any worker serves them)::

    keyserial dev                                           # one terminal
    pip install fastapi uvicorn
    uvicorn examples.fastapi_wallet.app:app                 # another (KEYSERIAL_REDIS_URL)

    curl -X POST localhost:8000/accounts/alice/deposit -H 'content-type: application/json' \\
         -d '{"amount": 100}'
    curl -X POST localhost:8000/transfers -H 'content-type: application/json' \\
         -d '{"source": "alice", "target": "bob", "amount": 30, "transfer_id": "t-1"}'

A ``transfer_id`` makes a transfer idempotent: sent again (a retry after a timeout), it answers
with the first outcome and moves nothing twice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

import keyserial
from keyserial.ledger import balance, deposit


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # One client per process, on the server's event loop: KEYSERIAL_REDIS_URL and the other
    # KEYSERIAL_* variables say where.
    async with keyserial.connect() as ks:
        app.state.ks = ks
        yield


app = FastAPI(title="wallet", lifespan=lifespan)


class Deposit(BaseModel):
    amount: int = Field(gt=0, description="cents")


class Transfer(BaseModel):
    source: str = Field(min_length=1)
    target: str = Field(min_length=1)
    amount: int = Field(gt=0, description="cents")
    transfer_id: str | None = Field(default=None, min_length=1, pattern=r"^[^#]+$")

    @model_validator(mode="after")
    def _two_accounts(self) -> Transfer:
        if self.source == self.target:
            raise ValueError("source and target must be two accounts")
        return self


def _key(account: str) -> str:
    return f"wallet:{account}"


@app.exception_handler(RequestValidationError)
async def bad_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """Bad input is the caller's mistake: 400, saying what is wrong."""
    problems = [f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in error.errors()]
    return JSONResponse({"error": "; ".join(problems)}, status_code=400)


@app.exception_handler(keyserial.InsufficientFunds)
async def insufficient(request: Request, error: keyserial.InsufficientFunds) -> JSONResponse:
    return JSONResponse({"error": error.message}, status_code=409)


@app.exception_handler(keyserial.MalformedOperation)
async def reused_id(request: Request, error: keyserial.MalformedOperation) -> JSONResponse:
    """A transfer_id already used by another transfer (another amount or accounts)."""
    return JSONResponse({"error": error.message}, status_code=409)


@app.exception_handler(keyserial.SubmitTimeout)
async def timed_out(request: Request, error: keyserial.SubmitTimeout) -> JSONResponse:
    # It may still apply: the client retries with the same transfer_id, which is safe.
    return JSONResponse({"error": str(error)}, status_code=503)


@app.get("/accounts/{account}")
async def get_balance(account: str, request: Request) -> dict[str, int]:
    ks: keyserial.Client = request.app.state.ks
    return {account: await ks.submit(_key(account), balance())}


@app.post("/accounts/{account}/deposit")
async def post_deposit(account: str, body: Deposit, request: Request) -> dict[str, int]:
    ks: keyserial.Client = request.app.state.ks
    return {account: await ks.submit(_key(account), deposit(body.amount))}


@app.post("/transfers")
async def post_transfer(body: Transfer, request: Request) -> dict[str, int]:
    ks: keyserial.Client = request.app.state.ks
    op_id = f"transfer:{body.transfer_id}" if body.transfer_id else None
    moved = await ks.transfer(_key(body.source), _key(body.target), body.amount, op_id=op_id)
    return {body.source: moved[_key(body.source)], body.target: moved[_key(body.target)]}
