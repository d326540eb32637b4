"""A new user follows the README, then the tutorial, as written: in one fresh venv, every shell
command of their fenced blocks run as the page gives it (plain ``pytest``, no PYTHONPATH, no
variable the page does not set), each file block written where its first line names, and the
README's example run as a script. A doc edit is thus tested: the commands and files come from
the pages themselves.

The only substitutions, each one a user would make on a busy machine or with a checkout:

- ``keyserial dev`` gets ``--port`` of a free port (6390 may be another test's, or a developer's
  own ``dev``), and the commands after it get the ``export KEYSERIAL_REDIS_URL=...`` that its
  ready line prints, as both pages say to paste on another port; the README's example names
  ``dev``'s URL, which becomes that one.
- ``uvicorn`` gets ``--port`` of a free port, and ``curl``'s ``localhost:8000`` becomes it.
- ``pip install keyserial`` (from PyPI) installs a wheel built from this checkout, and pip runs in
  the checkout, where the README's ``pip install -e .`` is typed.

Commands not run are in :data:`NOT_RUN`, each with why; the test lists the commands it ran, so
a command added to a page is noticed. A command whose comment shows what it prints is checked
against it (:data:`SHOWN`); every other command must succeed.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from keyserial.testing import free_port
from tests.helpers import ROOT

# A fresh venv, pip installs from the registry: over a minute.
pytestmark = pytest.mark.slow

README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"
#: A fenced block: its language, and its text.
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: The README's section whose Python block is a script to run (the others are fragments).
SCRIPT_SECTION = "30-second example"
#: What the README's example connects to, as written: ``keyserial dev``'s default server.
DEV_URL = "redis://127.0.0.1:6390/0"
#: Commands the pages give that this test does not run, and why.
NOT_RUN = {
    'pip install -e ".[dev]" && python -m pytest -q': "keyserial's own suite, this test"
    " among it: CI runs it (.ci/run; tests/project/test_readme.py checks that it is this command)",
    "keyserial bench": "minutes of benchmarks; tests/project/test_bench.py runs a short one",
    "keyserial bench --profile full": "a quarter of an hour of benchmarks",
}
#: What a command prints (stdout and stderr) that its page shows in its comment, and its
#: exit code.
SHOWN = {
    "python buy.py": ("98 seats left", 0),
    "curl -X POST 'localhost:8000/shows/42/orders/o-1?seats=2'": ('{"left":96}', 0),
    "keyserial call sku:42 reserve 2": ("keyserial: ValueError: only 0 left", 1),
    "pip install pytest && pytest": ("1 passed", 0),
    "pytest": ("4 passed", 0),
}
#: Seconds for one command; pip reaches the package registry.
TIMEOUT = 300


@dataclass
class Command:
    """One line of a shell block: as typed, without its comment."""

    text: str
    comment: str


@dataclass
class User:
    """A shell with the fresh venv activated, and the programs left running in it (their output
    in ``logs``)."""

    env: dict[str, str]
    logs: Path
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def type(self, command: Command, folder: Path) -> None:
        """Run ``command`` in ``folder`` as the page gives it (its ``&&`` parts in turn)."""
        parts = command.text.split(" && ")
        for number, part in enumerate(parts, 1):
            words = shlex.split(part)
            if words[:2] == ["keyserial", "dev"]:
                self._start_dev(words, folder)
            elif words[0] == "uvicorn":
                self._start_uvicorn(words, folder)
            else:
                shown = SHOWN.get(command.text) if number == len(parts) else None
                self._run(words, folder, command, shown)

    def _run(
        self, words: list[str], folder: Path, command: Command, shown: tuple[str, int] | None
    ) -> None:
        """Run a command to its end; it prints what the page shows, or at least succeeds."""
        if words[0] == "pip":
            if words == ["pip", "install", "keyserial"]:
                words = ["pip", "install", str(ROOT)]  # (PyPI's keyserial: this checkout's)
            folder = ROOT  # (where the README's `pip install -e .` is typed)
        if words[0] == "curl":
            served = f"localhost:{self.ports['uvicorn']}"
            words = [word.replace("localhost:8000", served) for word in words]
        result = subprocess.run(
            words, cwd=folder, env=self.env, capture_output=True, text=True, timeout=TIMEOUT
        )
        said = result.stdout + result.stderr
        text, code = shown or ("", 0)
        assert text in command.comment, f"the page no longer shows {text!r}: {command}"
        assert text in said, f"{command.text!r} did not print {text!r}:\n{said}"
        if words[0] == "pytest":  # (a warning, a deprecation say, is a fix the page leaves out)
            assert "warning" not in result.stdout.splitlines()[-1], said
        assert result.returncode == code, (
            f"{shlex.join(words)!r} exited {result.returncode}:\n{said}"
        )

    def _start_dev(self, words: list[str], folder: Path) -> None:
        """``keyserial dev`` on a free port; the next commands get the URL it prints, as the
        pages say. A ``dev`` already running is stopped first, as the README says to."""
        self.stop("dev")
        log = self._spawn([*words, "--port", str(free_port())], folder, "dev")
        said = self._wait(lambda: "keyserial dev: ready" in log.read_text(), "dev", log)
        export = re.search(r"export KEYSERIAL_REDIS_URL=(\S+)", log.read_text())
        assert export, said
        self.env["KEYSERIAL_REDIS_URL"] = export[1]

    def _start_uvicorn(self, words: list[str], folder: Path) -> None:
        port = self.ports["uvicorn"] = free_port()
        log = self._spawn([*words, "--port", str(port)], folder, "uvicorn")
        self._wait(lambda: _listening(port), "uvicorn", log)

    def _spawn(self, words: list[str], folder: Path, name: str) -> Path:
        log = self.logs / f"{name}-{len(list(self.logs.iterdir()))}.log"
        with log.open("wb") as output:
            self.running[name] = subprocess.Popen(
                words, cwd=folder, env=self.env, stdout=output, stderr=subprocess.STDOUT
            )
        return log

    def _wait(self, ready: Callable[[], bool], name: str, log: Path) -> str:
        """Until ``name`` serves; its log so far."""
        deadline = time.monotonic() + 60
        while not ready():
            assert self.running[name].poll() is None, f"{name} ended:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{name} did not serve:\n{log.read_text()}"
            time.sleep(0.05)
        return log.read_text()

    def stop(self, name: str) -> None:
        """Ctrl-C: the program must end, with code 0."""
        process = self.running.pop(name, None)
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                assert process.wait(timeout=30) == 0, f"{name} exited {process.returncode}"
            finally:
                process.kill()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _commands(body: str) -> Iterator[Command]:
    for line in body.splitlines():
        if line.strip():
            text, _, comment = line.partition("  #")
            yield Command(text.strip(), comment.strip())


def _section(page: str, start: int) -> str:
    """The heading of the section the text at ``start`` is in."""
    headings = re.findall(r"^#+ (.+)$", page[:start], re.MULTILINE)
    return headings[-1] if headings else ""


def follow(user: User, page_path: Path, folder: Path) -> list[str]:
    """Do what ``page_path`` says, in order, in ``folder``; the commands it ran."""
    page = page_path.read_text()
    folder.mkdir()
    ran: list[str] = []
    for block in BLOCK.finditer(page):
        language, body = block.groups()
        first = body.splitlines()[0] if body else ""
        named = re.fullmatch(r"# (\S+\.(?:py|ini|toml))", first)
        if language in {"python", "ini", "toml"} and named:
            path = folder / named[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
        elif language == "python" and _section(page, block.start()) == SCRIPT_SECTION:
            served = user.env["KEYSERIAL_REDIS_URL"]
            (folder / "example.py").write_text(body.replace(DEV_URL, served))
            _expect_the_example_s_output(user, folder)
            ran.append("python example.py")
        elif language in {"sh", "bash"}:
            for command in _commands(body):
                if command.text in NOT_RUN:
                    continue
                user.type(command, folder)
                ran.append(command.text)
    user.stop_all()
    return ran


def _expect_the_example_s_output(user: User, folder: Path) -> None:
    result = subprocess.run(
        ["python", "example.py"],
        cwd=folder,
        env=user.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["70 70", "refused: 70 < 1000", "later: 65"], result.stdout


def _a_new_user_s_environment(venv: Path) -> dict[str, str]:
    """This process's environment, less what a new user's shell would not have (this test's
    own pytest, keyserial and Python settings), with the venv activated."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTEST_", "KEYSERIAL_", "PYTHON", "VIRTUAL_ENV", "COV_"))
    }
    path = f"{venv / 'bin'}{os.pathsep}{kept.get('PATH', '')}"
    return {**kept, "PATH": path, "VIRTUAL_ENV": str(venv)}


@pytest.mark.timeout(900)
def test_a_new_user_follows_the_readme_then_the_tutorial_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (tmp_path / "logs").mkdir()
    user = User(_a_new_user_s_environment(venv), tmp_path / "logs")
    try:
        readme = follow(user, README, tmp_path / "readme")
        tutorial = follow(user, TUTORIAL, tmp_path / "shop")
    finally:
        for process in user.running.values():
            process.kill()
            process.wait()
    assert readme == [
        "pip install -e . && keyserial dev",
        "python example.py",
        "keyserial dev --app myapp.ops",
        "keyserial call sku:42 reserve 2",
        "pip install pytest && pytest",
    ]
    assert tutorial == [
        "pip install keyserial",
        "pip install fastapi uvicorn pytest httpx2",
        "keyserial dev --app shop.ops",
        "python buy.py",
        "uvicorn shop.web:app",
        "curl -X POST 'localhost:8000/shows/42/orders/o-1?seats=2'",
        "pytest",
    ]
