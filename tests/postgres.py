"""A private PostgreSQL server for tests: initdb + pg_ctl in a temporary directory, on a free
port of 127.0.0.1, trust authentication, removed afterwards (never the machine's own server)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from keyserial.testing import free_port

#: Where Debian's packages put the server binaries (initdb, pg_ctl are not on PATH there).
_DEBIAN_BINARIES = "/usr/lib/postgresql"
_TOOLS = ("initdb", "pg_ctl", "createdb")


def find_binaries() -> Path | None:
    """The directory of the newest ``initdb``, ``pg_ctl`` and ``createdb``, or None."""
    on_path = shutil.which("initdb")
    if on_path and all((Path(on_path).parent / tool).exists() for tool in _TOOLS):
        return Path(on_path).parent
    candidates = sorted(
        (
            path.parent
            for path in Path(_DEBIAN_BINARIES).glob("*/bin/initdb")
            if all((path.parent / tool).exists() for tool in _TOOLS)
        ),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    return candidates[-1] if candidates else None


class LocalPostgres:
    """``with LocalPostgres(bindir) as server: server.dsn("postgres")``.

    PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user
    (``runuser``), which owns the temporary directory.
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="keyserial-pg-"))
        self.data = self.directory / "data"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create an empty database; its DSN."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.dsn(name)

    def _run(self, tool: str, *args: str) -> None:
        command = [*self._as, str(self.bindir / tool), *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")

    def start(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.directory / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
