"""The nemesis: randomized fault schedules, chosen by a seed, against real workers and Redis.

``python -m tests.nemesis --seeds 200`` runs seeds 0-199 of the long profile; a failing seed
replays the same faults and ops (as far as timing allows) with ``--seed-start N --seeds 1``.
"""
