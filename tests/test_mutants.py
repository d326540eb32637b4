"""The fast subset of tests/mutants.py: each mutant must make one of its tests fail. (A full
run, every mutant, is ``python -m tests.mutants``; its table is in docs/claims.md.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import mypy.api
import pytest

from tests import mutants


def test_every_mutant_still_applies_to_the_library_exactly_once() -> None:
    """The mutants follow the code: an edit whose old text moved fails here first."""
    assert len(mutants.select(fast=False, only=[])) == len(mutants.MUTANTS)


@pytest.mark.timeout(600)
def test_every_python_mutant_type_checks(tmp_path: Path) -> None:
    """A mutant must die of the behaviour it breaks, not of a name the code no longer has (an
    AttributeError fails its tests just as well, and proves nothing). One test, one mypy cache:
    after the first, each check reads the unchanged modules from the cache. (About a second a
    mutant, a hundred of them: longer than the default timeout on a shared 2-core machine.)"""
    python_mutants = [m for m in mutants.MUTANTS if any(e.path.endswith(".py") for e in m.edits)]
    assert python_mutants
    failures = []
    for mutant in python_mutants:
        copy = tmp_path / mutant.name
        shutil.copytree(mutants.ROOT / "keyserial", copy / "keyserial")
        for path, text in mutants.mutated(mutant, copy).items():
            (copy / path).write_text(text)
        report, errors, status = mypy.api.run(
            [
                "--config-file",
                str(mutants.ROOT / "pyproject.toml"),
                "--cache-dir",
                str(tmp_path / ".mypy_cache"),
                str(copy / "keyserial"),
            ]
        )
        if status != 0:
            failures.append(f"{mutant.name}:\n{report}{errors}")
    assert not failures, "\n".join(failures)


def test_a_mutant_whose_old_text_is_gone_fails_loudly() -> None:
    drifted = mutants.Mutant(
        "drifted",
        "G1.1",
        "no such code",
        (mutants.Edit("keyserial/_scripts/lua/step.lua", "no such text", ""),),
        (),
    )
    with pytest.raises(mutants.MutantDrift, match="occurs 0 times"):
        mutants.mutated(drifted, mutants.ROOT)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutant", [m for m in mutants.MUTANTS if m.fast], ids=lambda m: m.name)
def test_the_fast_mutants_are_killed(mutant: mutants.Mutant) -> None:
    verdict = mutants.run(mutant)
    assert verdict.killed, f"mutant {mutant.name} survived: {mutant.what}"
