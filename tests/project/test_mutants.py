"""The fast subset of tests/mutants.py: each mutant must make one of its tests fail. (A full
run, every mutant, is ``python -m tests.mutants``; its table is in docs/mutants.md.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import mypy.api
import pytest

from tests import mutants


@pytest.mark.slow
def test_every_mutant_still_applies_to_the_library_exactly_once() -> None:
    """The mutants follow the code: an edit whose old text moved fails here first."""
    assert len(mutants.select(fast=False, only=[])) == len(mutants.MUTANTS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_python_mutant_type_checks(tmp_path: Path) -> None:
    """A mutant must die of the behaviour it breaks, not of a name the code no longer has (an
    AttributeError fails its tests just as well, and proves nothing). One copy of the package,
    each mutant written into it and then taken back out, and one mypy daemon over it: the daemon
    keeps the package in memory and re-checks only what changed and what depends on it, where a
    fresh mypy run re-reads the whole package for every mutant (22 s against 127 s). What the
    daemon reports, a full mypy run must confirm: its incremental state can be wrong after an
    update (a functools.cache function taken for Any), and a mutant fails on mypy's word."""
    python_mutants = [m for m in mutants.MUTANTS if any(e.path.endswith(".py") for e in m.edits)]
    assert python_mutants
    tree = tmp_path / "tree"
    shutil.copytree(
        mutants.ROOT / "keyserial", tree / "keyserial", ignore=shutil.ignore_patterns("__pycache__")
    )
    unmutated = _contents(tree)
    failures = []
    with _mypy_daemon(tmp_path, tree) as check:
        assert check() == "", "the unmutated package does not type-check"
        for stamp, mutant in enumerate(python_mutants, start=1):
            with _written(tree, mutants.mutated(mutant, tree), stamp):
                report = check() and _full_check(tmp_path, tree)
            if report:
                failures.append(f"{mutant.name}:\n{report}")
        assert _contents(tree) == unmutated, "the package did not come back whole"
        edited = sorted({e.path for m in python_mutants for e in m.edits})
        _assert_errors_are_seen(check, tree, edited, stamp=len(python_mutants) + 1)
    assert not failures, "\n".join(failures)


def _contents(tree: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(tree.rglob("*")) if path.is_file()}


def _full_check(tmp_path: Path, tree: Path) -> str:
    """mypy's report on the package in ``tree`` from a fresh run, "" when clean."""
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", *_mypy_options(tmp_path, "full"), str(tree / "keyserial")],
        cwd=tmp_path,
        env=_mypy_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    return "" if checked.returncode == 0 else checked.stdout + checked.stderr


def _mypy_options(tmp_path: Path, cache: str) -> list[str]:
    config = ["--config-file", str(mutants.ROOT / "pyproject.toml")]
    return [*config, "--cache-dir", str(tmp_path / f".mypy_cache_{cache}")]


def _mypy_env() -> dict[str, str]:
    """This environment without PYTHONPATH: mypy takes what the sys.path of its process holds
    for installed packages, and silences their errors; a PYTHONPATH may cover the copy."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def _assert_errors_are_seen(
    check: Callable[[], str], tree: Path, paths: list[str], *, stamp: int
) -> None:
    """A type error in each of ``paths`` fails the check: mypy silences the errors of files it
    takes for installed packages (see _mypy_env), and a check that reports nothing would pass
    every mutant."""
    canary = '\n_mutant_canary: int = "not an int"\n'
    with _written(tree, {path: (tree / path).read_text() + canary for path in paths}, stamp):
        report = check()
    unseen = [path for path in paths if f"{path}:" not in report]
    assert not unseen, f"type errors in {unseen} pass the check:\n{report}"


@contextlib.contextmanager
def _mypy_daemon(tmp_path: Path, tree: Path) -> Iterator[Callable[[], str]]:
    """A mypy daemon (strict, the project's config) over ``tree``, and a function that checks
    the package and returns mypy's report, "" when clean. The daemon is stopped on the way out,
    killed if it will not stop, and exits by itself after two idle minutes should this process
    die before either."""
    status = str(tmp_path / "dmypy.json")
    dmypy = [sys.executable, "-m", "mypy.dmypy", "--status-file", status]
    log = ["--log-file", str(tmp_path / "dmypy.log")]
    # A subprocess, not mypy.api.run_dmypy: starting the daemon forks the calling process.
    started = subprocess.run(
        [*dmypy, "start", "--timeout", "120", *log, "--", *_mypy_options(tmp_path, "daemon")],
        cwd=tmp_path,
        env=_mypy_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 0, f"dmypy did not start: {started.stdout}{started.stderr}"

    def check() -> str:
        # (mypy's client raises this process's recursion limit and leaves it so; the tests
        # after it in this worker rely on the default, as keyserial's codec refuses a value
        # nested too deeply by it.)
        limit = sys.getrecursionlimit()
        try:
            report, errors, code = mypy.api.run_dmypy(
                ["--status-file", status, "check", str(tree / "keyserial")]
            )
        finally:
            sys.setrecursionlimit(limit)
        assert code in (0, 1), f"the mypy daemon failed ({code}): {report}{errors}"
        return "" if code == 0 else report + errors

    try:
        yield check
    finally:
        stopped = subprocess.run([*dmypy, "stop"], capture_output=True, timeout=60)
        if stopped.returncode != 0:
            subprocess.run([*dmypy, "kill"], capture_output=True, timeout=60)


@contextlib.contextmanager
def _written(tree: Path, texts: dict[str, str], stamp: int) -> Iterator[None]:
    """``texts`` written over their files in ``tree``, and the files put back byte for byte
    after. mypy trusts a file whose size and whole-second mtime match what it saw last, and an
    edit and its undoing can share both: each write gets an mtime of its own (by ``stamp``, one
    per call) so that none is missed."""
    originals = {path: (tree / path).read_bytes() for path in texts}
    try:
        for path, text in texts.items():
            _write(tree / path, text.encode(), _EPOCH + 2 * stamp)
        yield
    finally:
        for path, data in originals.items():
            _write(tree / path, data, _EPOCH + 2 * stamp + 1)


_EPOCH = 2_000_000_000  # mtimes for the written files: later than any the checkout has


def _write(path: Path, data: bytes, mtime: int) -> None:
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))


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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutant", [m for m in mutants.MUTANTS if m.fast], ids=lambda m: m.name)
def test_the_fast_mutants_are_killed(mutant: mutants.Mutant) -> None:
    verdict = mutants.run(mutant)
    assert verdict.killed, f"mutant {mutant.name} survived: {mutant.what}"
