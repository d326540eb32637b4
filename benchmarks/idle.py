"""What an idle worker costs: its CPU and its Redis traffic against the number of shards it owns.

``python -m benchmarks.idle [--shards 16,256,1024] [--seconds 10]`` starts a private server
and, for each shard count, one worker process owning every shard of a fresh namespace. Once the
worker answers an op on every shard, nothing more is submitted, and over ``--seconds`` the
worker's CPU (``utime + stime`` from ``/proc``, as % of one core) and the server's commands
(``INFO`` ``total_commands_processed``) are measured: the lease renewals and the idle polls.
``--standby`` adds a second worker listing every shard (it owns none) and reports its CPU too;
the commands then include its acquire attempts. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    """User and system CPU the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def answer_on_every_shard(url: str, namespace: str, shards: int) -> None:
    """Submit an op to each shard, all at once: each is answered once the worker owns it."""
    async with keyserial.connect(url, shards=shards, namespace=namespace) as ks:
        keys: dict[int, str] = {}
        n = 0
        while len(keys) < shards:
            keys.setdefault(ks.shard_of(f"warm:{n}"), f"warm:{n}")
            n += 1

        async def answered(key: str) -> None:
            await ks.submit(key, deposit(1), timeout=120)

        async with anyio.create_task_group() as group:
            for key in keys.values():
                group.start_soon(answered, key)


def _commands_processed(client: redis.Redis) -> int:
    stats: dict[str, int] = client.info("stats")  # type: ignore[assignment]
    return stats["total_commands_processed"]


def measure(url: str, shards: int, seconds: float, standby: bool) -> dict[str, float]:
    namespace = f"idle-{shards}"
    command = [sys.executable, "-m", "keyserial", "worker", "--redis", url]
    command += ["--namespace", namespace, "--shard-count", str(shards), "--log-level", "WARNING"]
    workers = [subprocess.Popen(command, cwd=ROOT)]
    try:
        anyio.run(answer_on_every_shard, url, namespace, shards)
        if standby:
            workers.append(subprocess.Popen(command, cwd=ROOT))
        client = redis.Redis.from_url(url)
        time.sleep(3 if standby else 1)  # (the last commits settle; the standby's first round)
        cpu, commands = [cpu_seconds(w.pid) for w in workers], _commands_processed(client)
        time.sleep(seconds)
        cpu = [cpu_seconds(w.pid) - before for w, before in zip(workers, cpu, strict=True)]
        commands = _commands_processed(client) - commands - 1
        client.close()
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(60)
    row = {
        "shards": shards,
        "worker_cpu_percent": round(100 * cpu[0] / seconds, 2),
        "commands_per_s": round(commands / seconds, 1),
        "commands_per_shard_per_s": round(commands / seconds / shards, 3),
    }
    if standby:
        row["standby_cpu_percent"] = round(100 * cpu[1] / seconds, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle")
    parser.add_argument("--shards", default="16,256,1024", help="shard counts")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds each")
    parser.add_argument(
        "--standby", action="store_true", help="a second worker listing every shard, standing by"
    )
    args = parser.parse_args(argv)
    with LocalServer() as server:
        for shards in (int(count) for count in args.shards.split(",")):
            row = measure(server.url, shards, args.seconds, args.standby)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
