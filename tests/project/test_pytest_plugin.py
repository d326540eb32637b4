"""keyserial's pytest plugin, as a project that installed keyserial uses it: a test suite of its
own, run by pytest in a subprocess, with its ops module named in its ini file."""

from __future__ import annotations

import pytest

# A pytest run in a subprocess.
pytestmark = pytest.mark.slow

pytest_plugins = ("pytester",)

OPS = """
import keyserial

@keyserial.op
def double(ctx: keyserial.Context) -> int:
    ctx.state = (ctx.state or 0) * 2
    return ctx.state
"""

OTHER_OPS = """
import keyserial

@keyserial.op
def shout(ctx: keyserial.Context, word: str) -> str:
    return word.upper()
"""

SUITE = """
import pytest

import keyserial
from keyserial.ledger import deposit
from shop_ops import double


def test_a_sync_test_submits_through_the_client(keyserial_client):
    assert keyserial_client.submit("account:1", deposit(21)) == 21
    assert keyserial_client.submit("account:1", double()) == 42


def test_each_test_has_a_namespace_of_its_own(keyserial_client):
    assert keyserial_client.read("account:1") is None


@pytest.mark.asyncio
async def test_an_async_test_connects_to_the_worker(keyserial_worker):
    async with keyserial.connect(
        keyserial_worker.url, namespace=keyserial_worker.namespace
    ) as ks:
        await ks.submit("a", deposit(5))
        assert await ks.transfer("a", "b", 3) == {"a": 2, "b": 3}


@pytest.mark.keyserial_apps("other_ops")
def test_a_marker_names_other_op_modules(keyserial_client):
    import other_ops

    assert keyserial_client.submit("word", other_ops.shout("hi")) == "HI"
"""


def test_the_plugin_serves_each_test_its_own_namespace_worker_and_client(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nkeyserial_apps = shop_ops\n")
    pytester.makepyfile(shop_ops=OPS, other_ops=OTHER_OPS, test_shop=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=4)
