"""Python calls per op, by kind of op: ``python -m benchmarks.calls``.

The CPU per op that ``benchmarks.cost`` measures moves by 10-15% between runs of the same code
on a shared machine, more than most changes to the op's path. The number of calls the Python
code makes per op does not: it moves with the code and with batch sizes only. So each op kind
below runs on a private server, with its workers and one client process (64 callers) under
``cProfile``, switched on for the measured ops only, after a warm-up that also funds the
accounts; it prints, per op, the calls of Python functions and, apart, of functions written in
C (builtins and methods of built-in types), for the workers and for the client:

- **single key**: one worker owning every shard, deposits on random accounts;
- **transfer in one worker**: one worker, transfers between two accounts on different shards;
- **transfer in one of two workers**: two workers splitting the shards, transfers whose two
  shards one worker owns (the split's smaller steps, no grant protocol);
- **transfer between workers**: two workers splitting the shards; the row is derived from the
  two-worker mix and the transfers in one of two workers as ``benchmarks.cost`` derives it (the
  share that crosses, from the shard ranges; from the one-worker transfers where those are not
  measured);
- **transfer on a cluster**: one worker on a three-master Redis Cluster.

Only the main thread of each process is profiled: ops that run in a worker thread (sync ops
not declared ``inline``) are not counted; the ledger's ops run inline. A call of a coroutine
counts once per resumption (cProfile's count), so an ``await`` that suspends adds one.

``--by-module N`` adds, per op kind, the N modules the workers' Python calls per op go to most:
keyserial's by their path in the repository, the standard library's and third-party code by
package (``asyncio``, ``redis``), dataclasses' generated ``__init__`` functions apart.
``--by-function N`` adds the N functions they go to most, each named by its module, the line
it starts on and its name.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

import keyserial
from keyserial._local.cluster import LocalCluster
from keyserial._local.server import LocalServer
from keyserial.cli import main as keyserial_main

from .cost import crossing_share, derived_between
from .procs import shard_range
from .workloads import account_key, make_chooser

if TYPE_CHECKING:
    from _lsprof import profiler_entry

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 16
ACCOUNTS = 10_000
CALLERS = 64
#: The op kinds, each with its workers, its load and whether it runs on a cluster.
KINDS = {
    "single key": (1, "deposit", False),
    "transfer in one worker": (1, "transfer", False),
    "transfer in one of two workers": (2, "local-transfer", False),
    "transfer between workers": (2, "transfer", False),
    "transfer on a cluster": (1, "transfer", True),
}
#: What a table row shows, per kind of process.
FIGURES = ("python", "c")
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
#: The module named for dataclasses' generated ``__init__`` functions (their file: ``<string>``).
GENERATED_INIT = "dataclass __init__"
#: The key of all modules' calls, next to the modules' own.
ALL = "(all modules)"


def save_calls(profiler: cProfile.Profile, out: Path) -> None:
    """Save the profile's calls, of Python functions and of functions written in C, each
    function counted apart (``pstats`` keys functions by file, line and name, and keeps one of
    those that share them, such as every dataclass's generated ``__init__``); and, next to
    ``out`` (:func:`modules_file`), the Python calls summed by module (:func:`module_calls`) and
    by function (:func:`function_calls`)."""
    entries = profiler.getstats()
    python = c = 0
    for entry in entries:
        if isinstance(entry.code, str):  # (a built-in: its description, not a code object)
            c += entry.callcount
        else:
            python += entry.callcount
    # (The modules first: ``out`` appearing tells the parent both are written.)
    modules_file(out).write_text(json.dumps(module_calls(entries)))
    functions_file(out).write_text(json.dumps(function_calls(entries)))
    out.write_text(json.dumps({"python": python, "c": c}))


def modules_file(out: Path) -> Path:
    """Where :func:`save_calls` saves the per-module sums of the profile it saves to ``out``."""
    return out.with_name(f"{out.stem}.modules.json")


def functions_file(out: Path) -> Path:
    """Where :func:`save_calls` saves the per-function counts of the profile it saves to ``out``."""
    return out.with_name(f"{out.stem}.functions.json")


def function_calls(entries: Iterable[profiler_entry]) -> dict[str, int]:
    """The calls of each Python function, named ``<module> :<line> <name>`` (:func:`module_of`;
    the line its code starts on)."""
    calls: Counter[str] = Counter()
    for entry in entries:
        code = entry.code
        if not isinstance(code, str):
            calls[f"{module_of(code)} :{code.co_firstlineno} {code.co_name}"] += entry.callcount
    return dict(calls)


def module_calls(entries: Iterable[profiler_entry]) -> dict[str, int]:
    """The calls of Python functions, summed by :func:`module_of` their code."""
    calls: Counter[str] = Counter()
    names: dict[tuple[str, str], str] = {}  # (a file's module, looked up once per file)
    for entry in entries:
        code = entry.code
        if isinstance(code, str):
            continue
        # (``<string>`` is no one file: what it holds is told by the function's name.)
        key = (code.co_filename, code.co_name if code.co_filename == "<string>" else "")
        if key not in names:
            names[key] = module_of(code)
        calls[names[key]] += entry.callcount
    return dict(calls)


def module_of(code: CodeType) -> str:
    """Where a Python function's code is: a path in this repository, a package of the standard
    library or installed, a frozen module, :data:`GENERATED_INIT`, or its file as given."""
    filename = code.co_filename
    if filename == "<string>":
        return GENERATED_INIT if code.co_name == "__init__" else f"<string> {code.co_name}"
    if filename.startswith("<frozen "):  # (``<frozen importlib._bootstrap>``, ``<frozen os>``)
        return filename.removeprefix("<frozen ").removesuffix(">").split(".")[0]
    path = Path(filename).resolve()
    for installed in ("site-packages", "dist-packages"):
        if installed in path.parts:
            return _package(path.parts[path.parts.index(installed) + 1 :])
    if path.is_relative_to(ROOT):
        return path.relative_to(ROOT).as_posix()
    if path.is_relative_to(STDLIB):
        return _package(path.relative_to(STDLIB).parts)
    return filename


def _package(parts: Sequence[str]) -> str:
    """The top-level package (or module) of a path relative to a folder on ``sys.path``."""
    return parts[0].removesuffix(".py") if parts else "?"


def per_module(saved: Sequence[Path], ops: int) -> dict[str, float]:
    """The Python calls per op by module of the processes that saved ``saved``, summed."""
    return _per_op(map(modules_file, saved), ops)


def per_function(saved: Sequence[Path], ops: int) -> dict[str, float]:
    """The Python calls per op by function of the processes that saved ``saved``, summed."""
    return _per_op(map(functions_file, saved), ops)


def _per_op(files: Iterable[Path], ops: int) -> dict[str, float]:
    total: Counter[str] = Counter()
    for found in files:
        total.update(json.loads(found.read_text()))
    return {name: calls / ops for name, calls in total.items()}


def counts(saved: Path, ops: int) -> dict[str, float]:
    """Calls per op of a profile :func:`save_calls` saved."""
    calls = json.loads(saved.read_text())
    return {name: round(calls[name] / ops, 1) for name in FIGURES}


def summed(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    total: Counter[str] = Counter()
    for part in parts:
        total.update(part)
    return {name: round(total[name], 1) for name in FIGURES}


# -- the processes --------------------------------------------------------------------------


def _profiled(out: Path) -> cProfile.Profile:
    """A profiler that SIGUSR1 switches on and SIGUSR2 off, saving it to ``out``."""
    profiler = cProfile.Profile()

    def stop(*_: object) -> None:
        profiler.disable()
        save_calls(profiler, out)

    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, stop)
    return profiler


def _serve(out: Path, worker_args: list[str]) -> int:
    """A ``keyserial worker`` whose profile SIGUSR1 and SIGUSR2 start and save."""
    _profiled(out)
    return keyserial_main(["worker", *worker_args])


async def _load(url: str, op: str, accounts: int, ops: int, workers: list[int], out: Path) -> None:
    """Fund each account (the warm-up), then run ``ops`` ops with ``CALLERS`` callers, each
    process profiled meanwhile (this one included)."""
    kind = {"transfer": "pairs", "local-transfer": "local-pairs"}.get(op, "uniform")
    chooser = make_chooser(kind, accounts, random.Random(7), shards=SHARDS, ranges=len(workers))
    async with keyserial.connect(url, shards=SHARDS) as ks:
        for start in range(0, accounts, CALLERS):
            await asyncio.gather(
                *(
                    ks.submit(account_key(n), keyserial.call("deposit", 10**9))
                    for n in range(start, min(start + CALLERS, accounts))
                )
            )
        left = ops

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                accounts = chooser()
                if op != "deposit":
                    await ks.transfer(account_key(accounts[0]), account_key(accounts[1]), 1)
                else:
                    await ks.submit(account_key(accounts[0]), keyserial.call("deposit", 1))

        profiler = cProfile.Profile()
        for pid in workers:
            os.kill(pid, signal.SIGUSR1)
        profiler.enable()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        profiler.disable()
        # (Its last replies are in: what the workers do after them is not the ops'.)
        for pid in workers:
            os.kill(pid, signal.SIGUSR2)
        save_calls(profiler, out)


def _measure(
    kind: str, accounts: int, ops: int, folder: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """One kind's calls per op: of its workers (summed) and of its client; and its workers'
    Python calls per op by module and by function (under ``"module"`` and ``"function"``)."""
    worker_count, op, cluster = KINDS[kind]
    with LocalCluster(masters=3, replicas=0) if cluster else LocalServer() as server:
        url = server.url
        processes = []
        outs = [folder / f"worker-{n}.json" for n in range(worker_count)]
        for n, out in enumerate(outs):
            shards = ["--shards", shard_range(SHARDS, worker_count, n)]
            command = [sys.executable, "-m", "benchmarks.calls", "--as-worker", str(out), "--"]
            command += ["--redis", url, "--shard-count", str(SHARDS), "--log-level", "WARNING"]
            processes.append(subprocess.Popen(command + shards, cwd=ROOT))
        try:
            client_out = folder / "client.json"
            command = [sys.executable, "-m", "benchmarks.calls", "--as-client", str(client_out)]
            command += [url, op, str(accounts), str(ops), *(str(p.pid) for p in processes)]
            subprocess.run(command, cwd=ROOT, check=True, timeout=600)
            deadline = time.monotonic() + 30
            while not all(out.exists() for out in outs) and time.monotonic() < deadline:
                time.sleep(0.1)  # (each worker saves its profile on SIGUSR2, between two steps)
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=30)
        figures = {
            "workers": summed([counts(out, ops) for out in outs]),
            "client": counts(client_out, ops),
        }
        return figures, {"module": per_module(outs, ops), "function": per_function(outs, ops)}


# -- the table ------------------------------------------------------------------------------


def rows_of(measured: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """A row per op kind measured (a transfer between workers derived from the mix)."""
    rows = []
    for kind, found in measured.items():
        name = (
            "transfer between workers (measured mix)"
            if kind == "transfer between workers"
            else kind
        )
        rows.append({"kind": name, **found})
    mix = measured.get("transfer between workers")
    within = measured.get("transfer in one of two workers", measured.get("transfer in one worker"))
    if mix is not None and within is not None:
        share = crossing_share(SHARDS, 2)
        rows.append(
            {
                "kind": f"transfer between workers (derived: the {share:.0%} that cross)",
                "workers": derived_between(mix["workers"], within["workers"], share),
                "client": derived_between(mix["client"], within["client"], share),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| op kind | workers: Python calls/op | workers: C calls/op | client: Python calls/op"
        " | client: C calls/op |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        workers, client = row["workers"], row["client"]
        lines.append(
            f"| {row['kind']} | {workers['python']:,} | {workers['c']:,} | {client['python']:,}"
            f" | {client['c']:,} |"
        )
    return "\n".join(lines) + "\n"


def module_tables(
    modules: dict[str, dict[str, float]], largest: int, unit: str = "module"
) -> list[dict[str, Any]]:
    """Per op kind measured, the ``largest`` modules (or functions: ``unit``) by the workers'
    Python calls per op, and the calls per op of all of them (a transfer between workers
    derived as in :func:`rows_of`, if the one-worker transfer was measured too)."""
    tables = []
    for kind in modules:
        heading, figures, total = _module_figures(kind, modules)
        ranked = sorted(figures.items(), key=lambda item: (-item[1], item[0]))[:largest]
        tables.append(
            {
                "kind": heading,
                "python": round(total, 1),
                f"{unit}s": len(figures),
                "rows": [{unit: name, "python": round(calls, 1)} for name, calls in ranked],
            }
        )
    return tables


def _module_figures(
    kind: str, modules: dict[str, dict[str, float]]
) -> tuple[str, dict[str, float], float]:
    """A kind's heading, calls per op by module and in all: the mix's derived from the
    transfers that stay within a worker as :func:`rows_of` derives them, if those were
    measured."""
    mix = modules[kind]
    within = modules.get("transfer in one of two workers", modules.get("transfer in one worker"))
    if kind != "transfer between workers":
        return kind, mix, sum(mix.values())
    if within is None:
        heading = "transfer between workers (measured mix, not derived: none within a worker)"
        return heading, mix, sum(mix.values())
    share = crossing_share(SHARDS, 2)
    names = mix.keys() | within.keys()
    derived = derived_between(
        {name: mix.get(name, 0.0) for name in names} | {ALL: sum(mix.values())},
        {name: within.get(name, 0.0) for name in names} | {ALL: sum(within.values())},
        share,
    )
    total = derived.pop(ALL)
    return f"transfer between workers (derived: the {share:.0%} that cross)", derived, total


def modules_markdown(tables: list[dict[str, Any]], unit: str = "module") -> str:
    """A table per kind of :func:`module_tables`, with how much of the kind its rows hold."""
    lines = []
    for table in tables:
        lines += [
            f"### {table['kind']}: the workers' Python calls per op by {unit}",
            "",
            f"| {unit} | worker Python calls/op |",
            "|---|---:|",
            *(f"| `{row[unit]}` | {row['python']:,} |" for row in table["rows"]),
            "",
            f"The {len(table['rows'])} largest of {table[unit + 's']} {unit}s:"
            f" {sum(row['python'] for row in table['rows']):,.1f} of {table['python']:,} calls"
            " per op.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-worker"]:
        return _serve(Path(argv[1]), argv[3:])
    if argv[:1] == ["--as-client"]:
        out, url, op, accounts, ops, *pids = argv[1:]
        asyncio.run(_load(url, op, int(accounts), int(ops), [int(pid) for pid in pids], Path(out)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__)
    parser.add_argument("--ops", type=int, default=20_000, help="measured ops per kind")
    parser.add_argument(
        "--accounts", type=int, default=ACCOUNTS, help="accounts, each funded before the ops"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated op kinds")
    parser.add_argument("--out", type=Path, help="folder for calls.json and calls.md")
    parser.add_argument(
        "--by-module",
        type=int,
        metavar="N",
        help="also print, per op kind, the N modules with the most worker Python calls per op",
    )
    parser.add_argument(
        "--by-function",
        type=int,
        metavar="N",
        help="also print, per op kind, the N functions with the most worker Python calls per op",
    )
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.kinds.split(",")]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"unknown op kind(s) {unknown}; choose from {list(KINDS)}")
    for flag, value in (("--by-module", args.by_module), ("--by-function", args.by_function)):
        if value is not None and value < 1:
            parser.error(f"{flag} takes a number of rows, 1 or more")
    measured, grouped = _measure_kinds(kinds, args.accounts, args.ops)
    command = "python -m benchmarks.calls " + " ".join(argv)
    text = markdown(rows_of(measured), command.strip())
    tables: dict[str, list[dict[str, Any]]] = {}
    for unit, largest in (("module", args.by_module), ("function", args.by_function)):
        if largest:
            by_kind = {kind: groups[unit] for kind, groups in grouped.items()}
            tables[unit] = module_tables(by_kind, largest, unit)
            text += "\n" + modules_markdown(tables[unit], unit)
    print(text)
    if args.out is not None:
        _write(args.out, text, rows_of(measured), tables)
    return 0


def _measure_kinds(
    kinds: list[str], accounts: int, ops: int
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, dict[str, float]]]]:
    """The kinds' calls per op (:func:`_measure`), in :data:`KINDS`' order, and by module and
    by function."""
    measured: dict[str, dict[str, dict[str, float]]] = {}
    grouped: dict[str, dict[str, dict[str, float]]] = {}
    for kind in KINDS:
        if kind in kinds:
            with tempfile.TemporaryDirectory() as folder:
                measured[kind], grouped[kind] = _measure(kind, accounts, ops, Path(folder))
    return measured, grouped


def _write(
    out: Path, text: str, rows: list[dict[str, Any]], tables: dict[str, list[dict[str, Any]]]
) -> None:
    """``calls.md``, ``calls.json`` and, with ``--by-module`` or ``--by-function``,
    ``calls-by-module.json`` or ``calls-by-function.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "calls.md").write_text(text)
    (out / "calls.json").write_text(json.dumps(rows, indent=2) + "\n")
    for unit, unit_tables in tables.items():
        (out / f"calls-by-{unit}.json").write_text(json.dumps(unit_tables, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
