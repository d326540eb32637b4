"""JSON views over the wallets. Before keyserial, ``charge`` did this::

    while not cache.add(f"lock:wallet:{user}", 1, timeout=10):   # spin until we hold the lock
        time.sleep(0.1)
    try:
        balance = cache.get(f"wallet:{user}", 0)
        if balance < amount: ...
        cache.set(f"wallet:{user}", balance - amount)
    finally:
        cache.delete(f"lock:wallet:{user}")                       # maybe someone else's lock

A holder paused past the 10 s timeout writes after the next holder, and waiters poll. Now the
view submits one op; the worker runs the wallet's ops one after another.
"""

import json
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

import keyserial
from wallet.client import keyserial_client


def _key(user: str) -> str:
    return f"wallet:{user}"


@require_GET
def wallet(request: HttpRequest, user: str) -> JsonResponse:
    return JsonResponse({"user": user, "balance": keyserial_client().read(_key(user)) or 0})


def _body(request: HttpRequest, *fields: str) -> dict[str, Any] | None:
    """The request's JSON object, if it has ``fields``; None for anything else."""
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    return body if isinstance(body, dict) and all(name in body for name in fields) else None


def _error(user: str, message: str, status: int) -> JsonResponse:
    return JsonResponse({"user": user, "error": message}, status=status)


@csrf_exempt
@require_POST
def top_up(request: HttpRequest, user: str) -> JsonResponse:
    if (body := _body(request, "amount")) is None:
        return _error(user, 'send a JSON object {"amount": cents}', 400)
    try:
        balance = keyserial_client().submit(_key(user), keyserial.call("top_up", body["amount"]))
    except keyserial.OperationFailed as failed:
        if failed.error_type != "ValueError":  # (the op's refusal of a bad amount)
            raise
        return _error(user, failed.message, 400)
    return JsonResponse({"user": user, "balance": balance})


@csrf_exempt
@require_POST
def charge(request: HttpRequest, user: str) -> JsonResponse:
    """Charge an order once: the order id is the op id, so a retried request (a double click,
    a client's retry after a timeout) returns the first charge's outcome instead of charging
    again, and the same order id with another amount is refused (409)."""
    if (body := _body(request, "amount", "order_id")) is None:
        return _error(user, 'send a JSON object {"amount": cents, "order_id": id}', 400)
    try:
        balance = keyserial_client().submit(
            _key(user),
            keyserial.call("charge", body["amount"]),
            op_id=f"charge:{body['order_id']}",
        )
    except keyserial.InsufficientFunds as refused:
        return JsonResponse(
            {"user": user, "error": "insufficient funds", "balance": refused.balance}, status=402
        )
    except keyserial.MalformedOperation as conflict:  # (the order id names another charge)
        return _error(user, conflict.message, 409)
    except keyserial.OperationFailed as failed:
        if failed.error_type != "ValueError":
            raise
        return _error(user, failed.message, 400)
    return JsonResponse({"user": user, "balance": balance})
