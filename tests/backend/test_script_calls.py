"""The typed script calls (``keyserial/_*_scripts.py``) fit the Lua scripts they wrap: each names
as many arguments as its script reads, and the scripts that publish the replies of what they
commit name that argument ``replies``, which the pipeliner fills."""

from __future__ import annotations

import re

import pytest

from keyserial._scripts.calls import REPLIES, Script
from keyserial._scripts.commit import StepArgs
from keyserial._scripts.cross import ResolveArgs
from keyserial._scripts.lease import AcquireArgs, ReleaseArgs, RenewArgs
from keyserial._scripts.submit import STATUS, SubmitArgs

STEP = StepArgs.SCRIPT
#: Every script.
FIXED = [
    SubmitArgs.SCRIPT,
    STATUS,
    AcquireArgs.SCRIPT,
    RenewArgs.SCRIPT,
    ReleaseArgs.SCRIPT,
    STEP,
    ResolveArgs.SCRIPT,
]


@pytest.mark.parametrize("script", FIXED, ids=lambda script: script.name)
def test_a_typed_call_names_every_argument_its_script_reads(script: Script) -> None:
    read = [int(index) for index in re.findall(r"ARGV\[(\d+)\]", script.text)]
    assert len(script.argv) == max(read, default=0)


def test_the_scripts_that_publish_replies_name_them_for_the_pipeliner() -> None:
    assert [script.name for script in FIXED if script.publishes] == ["step"]
    documented = re.search(
        r"^-- ARGV\[(\d+)\] +replies \(and the messages", STEP.text, re.MULTILINE
    )
    assert documented, "step.lua's header documents its replies argument"
    assert STEP.argv.index(REPLIES) + 1 == int(documented.group(1))
