"""The keyserial benchmark suite: keyserial against lock-based baselines on one private server.

Run it with ``keyserial bench`` (or ``python -m benchmarks``); see ``benchmarks/README.md``.

Modules, one job each:

* :mod:`benchmarks.config` — systems, workloads, profiles and the parameters of one run;
* :mod:`benchmarks.workloads` — which keys each op touches (hot, Zipf, uniform, pairs);
* :mod:`benchmarks.systems` — the systems as their users run them (client side);
* :mod:`benchmarks.notifylock` — an asyncio port of python-redis-lock;
* :mod:`benchmarks.ops` — the worker app with the slow-I/O op for keyserial;
* :mod:`benchmarks.state` — key names, seeding, final-state reads and clean-up on the server;
* :mod:`benchmarks.agent` — a client process: C concurrent callers, latencies, CPU;
* :mod:`benchmarks.procs` — starting and driving client processes and keyserial workers;
* :mod:`benchmarks.runner` — the run matrix, timing, correctness, progress lines;
* :mod:`benchmarks.metrics` — percentiles, ``INFO commandstats`` diffs, CPU readings;
* :mod:`benchmarks.machine` — what the run ran on;
* :mod:`benchmarks.targets` — the issue's targets checked against one run's figures;
* :mod:`benchmarks.report` — the Markdown table, the JSON file and the PNG chart;
* :mod:`benchmarks.cli` — the ``keyserial bench`` command line.
"""
