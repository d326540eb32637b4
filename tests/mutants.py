"""Mutants that must die: semantic breakages of keyserial that the claim map's tests must catch.

``python -m tests.mutants [--fast] [--only NAME]... [--list | --markdown]`` applies each mutant,
one at a time, to a fresh copy of the repository in a temporary directory (the working tree is
never touched), runs the tests the claim map names for it there (``PYTHONPATH`` pointing at the
copy), and reports whether some test failed (killed) or all passed (survived). It exits 1 if
any mutant survived. ``--markdown`` prints what each breaks, as docs/mutants.md shows it.

A mutant is a list of exact text replacements; each old text must occur exactly once in its
file, or the run fails loudly: when the library's code moves, the list must move with it.
``--fast`` runs the subset CI runs (``tests/project/test_mutants.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Never copied: caches, VCS data, and benchmark output nothing here reads.
_SKIP = shutil.ignore_patterns(
    ".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "results", "*.egg-info"
)
#: A mutant's tests that hang are stopped after this long (the mutant counts as killed).
MUTANT_TIMEOUT = 300.0


class MutantDrift(RuntimeError):
    """A mutant's old text no longer occurs exactly once: the library moved, fix the list."""

    def __init__(self, mutant: str, path: str, count: int) -> None:
        super().__init__(
            f"mutant {mutant!r}: its old text occurs {count} times in {path}"
            " (expected exactly once); update tests/mutants.py"
        )
        self.mutant, self.path, self.count = mutant, path, count


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    claim: str  # the claim map's id (docs/claims.md)
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    fast: bool = False


def _no_fence(path: str, check: str) -> Edit:
    return Edit(path, check, "if false then")


_LUA = "keyserial/_scripts/lua/"
_STEP = "keyserial/_scripts/lua/step.lua"
_FROZEN = "tests/faults/test_faults.py::test_a_frozen_owner_resumed_after_takeover_cannot_commit"
_XS = "tests/crossshard/test_cross_shard_faults.py::"
_ZW = "tests/crossshard/test_zombie_writes.py::"
_STANDALONE = "[standalone]"
_RESHARD = "tests/reshard/test_reshard.py::"
_SHARD = "keyserial/_worker/runner.py"
_COORDINATOR = "keyserial/_worker/crossshard/coordinator.py"
_PARTICIPANT = "keyserial/_worker/crossshard/participant.py"
_RACES = "tests/crossshard/test_cross_shard_races.py::"
_GRANTS = "tests/crossshard/test_grant_requests.py::"
_DEFAULT = "tests/project/test_default_server.py::"
_STALE = "tests/reshard/test_shard_count_after_reshard.py::"
_DASHBOARD_APP = "keyserial/_dashboard/app.py"
_TOKEN_CHECK = (
    '            if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):\n'
)
_TOKEN_TEST = "tests/operator/test_dashboard.py::test_the_api_answers_only_to_the_token"
_MOVER = "keyserial/_reshard/mover.py"
_IDEMPOTENT = "tests/backend/test_scripts_idempotent.py::"


def _token_unchecked_on(action: str) -> Edit:
    """The dashboard's API takes a request to ``.../<action>`` without the token."""
    return Edit(
        _DASHBOARD_APP,
        _TOKEN_CHECK,
        f'            if not request.url.path.endswith("/{action}")'
        " and not secrets.compare_digest(\n"
        '                given.encode(), f"Bearer {token}".encode()\n'
        "            ):\n",
    )


def _no_check(path: str, check: str) -> Edit:
    """A Python check that never refuses."""
    return Edit(path, check, check.split("if ", 1)[0] + "if False:\n")


_SUSPECT = "            if self._replay.suspect is not None and self._replay.runs_alone(run):\n"
_PUSH = "tests/client/test_push.py::"
_INBOX = "tests/worker/test_inbox.py::"
_HOSTILE = "tests/security/test_hostile_clients.py::"
_INTAKE = "keyserial/_worker/intake.py"
_LEASE = "tests/backend/test_lease_scripts.py::"
_RELEASE_LUA = "keyserial/_scripts/lua/release.lua"
_LIB = "keyserial/_scripts/lua/lib.lua"
_TIMER_SCRIPTS = "tests/timers/test_timer_scripts.py::"
_DELAYED = "tests/timers/test_delayed_ops.py::"
_HAND = "tests/timers/test_hand_pushed_timers.py::"
_OP_TIMERS = "tests/timers/test_op_timers.py::"
_EXECUTION = "keyserial/_worker/execution.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "step-no-epoch-check",
        "G1.1",
        "step.lua commits without checking the owner's epoch",
        (_no_fence(_STEP, "if redis.call('GET', KEYS[1]) ~= ARGV[1] then"),),
        (_FROZEN + _STANDALONE,),
        fast=True,
    ),
    Mutant(
        "replay-skips-lone-surrogate-entries",
        "G6.4",
        "step.lua looks up no stored outcome of an entry holding a lone surrogate",
        (
            Edit(
                _STEP,
                "    local ok, ops = decode_ops(ops_json)",
                "    local ok, ops = pcall(cjson.decode, ops_json)",
            ),
        ),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_replaying_step_finds_the_outcomes_of_an_entry_holding_a_lone_surrogate"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "cross-shard-step-no-epoch-check",
        "G5.3",
        "step.lua records a decision or a grant without checking the owner's epoch",
        (_no_fence(_STEP, "if redis.call('GET', KEYS[1]) ~= ARGV[1] then"),),
        (
            _ZW + "test_a_zombie_coordinator_s_decision_reaches_redis_and_is_refused" + _STANDALONE,
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_grant_under_an_epoch_that_moved_on_is_refused_and_records_nothing"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "step-no-other-shard-epoch-check",
        "G5.3",
        "step.lua writes a cross-shard op's other shards without checking their epochs",
        (Edit(_STEP, "    if not owns_other(other[1], other[2]) then\n", "    if false then\n"),),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_a_participant_shard_changing_hands_mid_op_lands_the_op_once"
            "[while the op runs]",
            _XS
            + "test_a_participant_that_lost_its_shard_after_a_lent_grant_refuses_the_home_s_step"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "lent-writes-left-out",
        "G5.1",
        "the home's step commits a decision without the writes of the shards that lent their"
        " keys (their owners cache the writes from the notice, Redis never has them)",
        (Edit(_COORDINATOR, "        if attempt.lent:\n", "        if False:\n"),),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_signed_grants_and_decisions_are_taken_without_reading_their_records"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "lent-decision-applied-whatever-its-grant",
        "G5.18",
        "a participant that lent its keys takes a decision's writes into its cache though the"
        " decision names another grant (a captured request replayed after its attempt was"
        " decided: the old writes undo what ran on the key since)",
        (
            Edit(
                _PARTICIPANT,
                "            and decision.lent.get(home.shard) == grant.fence\n",
                "            and True\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_request_replayed_after_its_part_was_applied_holds_nothing"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "lent-grant-never-sent-again",
        "G5.17",
        "a participant holding keys under a lent grant ignores the coordinator's request sent"
        " again (the first grant's message lost: the coordinator waits for ever)",
        (
            Edit(
                _PARTICIPANT,
                "            self.granted(request, run.grant, None)\n",
                "            pass\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_request_replayed_while_its_attempt_is_held_is_ignored"
            + "[standalone-replayed]",
        ),
    ),
    Mutant(
        "lent-grant-before-its-keys-commit",
        "G5.1",
        "a participant lends keys whose earlier writes or outcomes have not committed yet",
        (
            Edit(
                _PARTICIPANT,
                "        return not self._services.home.states.all_committed(",
                "        return False and not self._services.home.states.all_committed(",
            ),
        ),
        tuple(
            _GRANTS
            + "test_a_lent_grant_goes_out_only_once_its_keys_earlier_writes_have_committed"
            + f"[{earlier}]"
            for earlier in ("write", "outcome")
        ),
    ),
    Mutant(
        "step-no-dedup-lookup",
        "G3.2",
        "step.lua never looks up a fetched op id's stored outcome",
        (Edit(_STEP, "          if not fresh then\n", "          if false then\n"),),
        (
            "tests/client/test_submit.py::"
            "test_a_resubmitted_op_id_returns_the_stored_result_and_never_runs_twice" + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "step-no-retention-guard",
        "G3.5",
        "step.lua rotates results away although an entry past progress may need them",
        (Edit(_STEP, "  if oldest and parse_id(oldest[1]) < since then\n", "  if false then\n"),),
        (
            "tests/faults/test_reliability.py::"
            "test_results_a_replay_needs_outlive_the_retention_while_progress_is_pinned"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "raise-keeps-state",
        "G2.4",
        "a sync op that raises keeps what it wrote to ctx.state",
        (
            Edit(
                "keyserial/_worker/execution.py",
                "no context manager either)\n"
                "            value = _called(definition.fn, context, envelope)\n",
                "no context manager either)\n"
                "            value = _called(definition.fn, context, envelope)\n"
                "            if isinstance(value, _Raised) and isinstance(context, Context):\n"
                "                self.states.write(context.key, context.encoded_state())\n",
            ),
        ),
        (
            "tests/worker/test_failed_ops.py::test_an_op_that_raises_after_writing_state_keeps_nothing"
            "[standalone-sync]",
        ),
        fast=True,
    ),
    Mutant(
        "grant-skips-decision-record",
        "G5.2",
        "a participant that missed the decision notice releases its keys as if aborted, without"
        " reading the decision record",
        (
            Edit(
                "keyserial/_worker/crossshard/participant.py",
                "            try:\n                # Durably: a decision read",
                '            return Decision({}, "assumed")\n'
                "            try:\n                # Durably: a decision read",
            ),
        ),
        (_XS + "test_participant_killed_while_holding_keys" + _STANDALONE,),
    ),
    Mutant(
        "idle-grant-never-polls",
        "G5.2",
        "a participant holding keys with no task never reads the decision record when no"
        " decision is handed over",
        (
            Edit(
                "keyserial/_worker/crossshard/participant.py",
                "        if self._recorded:\n            self._end_with_task(",
                "        if False:\n            self._end_with_task(",
            ),
        ),
        (_XS + "test_coordinator_killed_after_the_first_grant" + _STANDALONE,),
    ),
    Mutant(
        "asking-never-polls",
        "G5.2",
        "a coordinator asking for grants with no task never reads the grant's record, nor asks"
        " the shard's owner again, when no grant is handed over",
        (
            Edit(
                _COORDINATOR,
                "            return\n        self._to_task(waiter)\n\n    def _to_task(",
                "            return\n\n    def _to_task(",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_a_grant_request_lost_with_a_dead_owner_is_sent_again_to_the_next_one"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "waits-miss-an-earlier-deadline",
        "G5.2",
        "a cross-shard wait with an earlier deadline than the waits before it waits for theirs",
        (
            Edit(
                "keyserial/_worker/crossshard/mailbox.py",
                "        if self._timer is None or deadline < self._timer_at:\n",
                "        if self._timer is None:\n",
            ),
        ),
        (
            "tests/crossshard/test_mailbox_waits.py::"
            "test_a_wait_ends_at_its_deadline_even_behind_a_later_one",
        ),
    ),
    Mutant(
        "sync-across-releases-before-commit",
        "G5.1",
        "a sync cross-shard op lets its keys go before the step that commits it lands",
        (
            Edit(
                _COORDINATOR,
                "        self._commit_with_step(run, split, others, states, evaluated, landed)\n",
                "        for owner, hold in holds:\n            owner.release(hold)\n"
                "        self._commit_with_step(\n"
                "            run, split, others, states, evaluated, lambda _: None\n"
                "        )\n",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_concurrent_sync_payments_of_one_worker_across_shards_apply_each_once"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "async-across-releases-before-commit",
        "G5.1",
        "an async cross-shard op of one worker lets the other shards' keys go before it commits",
        (
            Edit(
                _COORDINATOR,
                "                yield _Held(run, split, others, states, fences)\n",
                "                await stack.aclose()\n"
                "                yield _Held(run, split, others, states, fences)\n",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_an_op_on_a_participant_key_waits_for_the_cross_shard_op_holding_it"
            "[standalone-one worker]",
        ),
    ),
    Mutant(
        "poll-skips-dormant",
        "G6.22",
        "the worker's poll never wakes a dormant shard whose stream has new entries",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "                if has_entries:\n",
                "                if False:\n",
            ),
        ),
        (
            "tests/worker/test_idle.py::"
            "test_an_entry_appended_with_no_wake_up_to_a_dormant_shard_is_found_by_the_poll"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "standby-deaf-to-release",
        "G6.22",
        "a standby ignores the wake-up of a released shard: it waits out the lease it last saw",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "            self._leases.try_soon(shard)",
                "            pass",
            ),
        ),
        (
            "tests/worker/test_idle.py::"
            "test_a_standby_tries_a_held_shard_once_its_lease_may_end_and_at_once_on_release"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "pause-ignored",
        "G8.26",
        "a worker reads the paused keys but holds none of them",
        (
            Edit(
                "keyserial/_worker/pauses.py",
                "            self._held[key] = self._chains.hold((key,))\n",
                "            continue\n",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_a_paused_key_s_ops_queue_while_its_shard_flows_and_run_in_order_once_resumed"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "pause-forgotten-at-takeover",
        "G8.26",
        "a new owner does not read the paused keys when it takes the shard over",
        (
            Edit(
                "keyserial/_worker/runner.py",
                "                await self._follow_pauses()  # (recorded in Redis: honoured from"
                " the first op)\n",
                "",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_the_next_owner_of_an_idle_shard_honours_a_pause_before_its_first_op"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "trace-context-not-sent",
        "G8.27",
        "a traced submit sends no trace context with its op",
        (Edit("keyserial/_wire/codec.py", "    if trace:\n", "    if False:\n"),),
        (
            "tests/operator/test_telemetry.py::"
            "test_a_traced_submit_and_the_op_s_run_are_one_trace_across_processes" + _STANDALONE,
        ),
    ),
    Mutant(
        "run-span-hides-failure",
        "G8.27",
        "the span of an op that raised records neither the error nor its exception",
        (
            Edit(
                "keyserial/_telemetry.py",
                "        if (error := run.error) is not None:\n",
                "        if (error := run.error) is not None and False:\n",
            ),
        ),
        (
            "tests/operator/test_telemetry.py::"
            "test_a_traced_submit_and_the_op_s_run_are_one_trace_across_processes" + _STANDALONE,
        ),
    ),
    Mutant(
        "preload-past-cache-bound",
        "G2.7",
        "a takeover preloads a shard up to preload_states, whatever max_cached_states says",
        (
            Edit(
                "keyserial/_worker/runner.py",
                "        limit = min(self._settings.preload_states,"
                " self._settings.max_cached_states)\n",
                "        limit = self._settings.preload_states\n",
            ),
        ),
        (
            "tests/worker/test_state_cache.py::"
            "test_a_takeover_preloads_only_a_shard_within_the_cache_bound" + _STANDALONE,
        ),
    ),
    Mutant(
        "home-keeps-other-shards-states",
        "G2.7",
        "the home shard of a cross-shard op keeps the states its step read of the op's keys on"
        " other shards (stale once their owners write them, and counted against its bound)",
        (
            Edit(
                "keyserial/_worker/crossshard/cross_shard.py",
                "                home.states.forget(key)\n",
                "",
            ),
        ),
        (
            "tests/worker/test_state_cache.py::"
            "test_a_home_shard_keeps_no_state_of_another_shard_s_key[standalone-at once]",
        ),
    ),
    Mutant(
        "sync-op-inline-by-default",
        "G6.23",
        "a plain sync op runs on the worker's event loop, as if declared inline=True",
        (
            Edit(
                "keyserial/_ops.py",
                "        self.inline = inline\n",
                "        self.inline = inline or not self.is_async\n",
            ),
        ),
        (
            "tests/worker/test_blocking_ops.py::"
            "test_a_plain_sync_cpu_bound_op_stalls_no_other_key_and_loses_no_lease" + _STANDALONE,
        ),
    ),
    Mutant(
        "inline-declaration-ignored",
        "G6.23",
        "an op declared inline=True runs in a worker thread all the same",
        (
            Edit(
                "keyserial/_ops.py",
                "        self.inline = inline\n",
                "        self.inline = False\n",
            ),
        ),
        (
            "tests/worker/test_blocking_ops.py::"
            "test_a_sync_op_declared_inline_runs_on_the_event_loop_and_a_plain_one_off_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sync-trip-forgets-state",
        "G2.1",
        "a key's sync ops sharing a trip to a thread each see the state before the trip",
        (
            Edit(
                "keyserial/_worker/execution.py",
                "                state = evaluated[1][run.envelope.key]\n",
                "                pass\n",
            ),
        ),
        (
            "tests/worker/test_blocking_ops.py::"
            "test_plain_sync_ops_on_one_key_run_one_after_another_in_stream_order" + _STANDALONE,
        ),
    ),
    Mutant(
        "sync-trips-overlap",
        "G2.1",
        "a key's chain moves on without waiting for its sync ops' trip to a thread",
        (
            Edit(
                "keyserial/_worker/chains.py",
                "                    await self._executor.execute_in_thread("
                "self._trip(item, chain))\n",
                "                    assert self._tasks is not None\n"
                "                    self._tasks.start_soon(\n"
                "                        self._executor.execute_in_thread,"
                " self._trip(item, chain)\n"
                "                    )\n",
            ),
        ),
        (
            "tests/worker/test_blocking_ops.py::"
            "test_plain_sync_ops_on_one_key_run_one_after_another_in_stream_order" + _STANDALONE,
        ),
    ),
    Mutant(
        "cancelled-in-thread-ends-runner",
        "G6.4",
        "a CancelledError raised by a sync op in a thread looks for a task, and ends the runner",
        (
            Edit(
                "keyserial/_worker/execution.py",
                "        return _Raised(_escaped(exc, on_loop=on_loop))\n",
                "        return _Raised(_escaped(exc))\n",
            ),
        ),
        (
            "tests/worker/test_failed_ops.py::test_an_op_that_lets_a_cancellation_out_fails_alone"
            "[standalone-sync in a thread]",
        ),
    ),
    Mutant(
        "client-forgets-sweep",
        "G6.2",
        "the client never looks up overdue replies",
        (
            Edit(
                "keyserial/_client/sweep.py",
                "        self._early = anyio.Event()\n        while True:\n",
                "        self._early = anyio.Event()\n        await anyio.sleep_forever()\n"
                "        while True:\n",
            ),
        ),
        (
            "tests/client/test_lost_replies.py::test_a_lost_reply_is_fetched_by_the_client_s_sweep"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "worker-sleeps-through-resubscribe",
        "G6.24",
        "a worker whose subscription came back does not read its shards until the idle poll",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "                    on_resubscribed=self._wake_every_runner,\n",
                "",
            ),
        ),
        (
            "tests/client/test_subscription_health.py::"
            "test_what_was_published_while_subscriptions_were_down_is_read_at_once" + _STANDALONE,
        ),
    ),
    Mutant(
        "client-waits-for-sweep-after-resubscribe",
        "G6.24",
        "a client whose reply subscription came back waits for the sweep",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                "                on_resubscribed=self._sweep.now,\n",
                "",
            ),
        ),
        (
            "tests/client/test_subscription_health.py::"
            "test_a_reply_published_while_the_client_resubscribes_is_looked_up_at_once[standalone]",
        ),
    ),
    Mutant(
        "release-resets-horizon",
        "G3.3",
        "release.lua sets the horizon back to progress: the next owner forgets what to look up",
        (
            Edit(
                "keyserial/_scripts/lua/release.lua",
                "  horizon = fold_pushes(KEYS[2], KEYS[5], KEYS[7], KEYS[8], KEYS[9])\nend\n",
                "  horizon = fold_pushes(KEYS[2], KEYS[5], KEYS[7], KEYS[8], KEYS[9])\nend\n"
                "redis.call('SET', KEYS[2], redis.call('GET', (string.gsub(KEYS[2], 'horizon$',"
                " 'progress'))) or '0-0')\n"
                "horizon = redis.call('GET', KEYS[2])\n",
            ),
        ),
        (
            "tests/faults/test_reliability.py::test_a_graceful_stop_never_replays_an_op_that_committed"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "replay-runs-every-op-alone",
        "G6.5",
        "after a crash, the new owner runs every replayed op alone, a lease TTL at most each",
        (Edit(_SHARD, _SUSPECT, "            if self._replay.replaying:\n"),),
        (
            "tests/faults/test_reliability.py::"
            "test_a_takeover_with_many_stuck_ops_in_flight_stalls_its_shard_one_lease_ttl_at_most"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "suspect-runs-with-others",
        "G6.3",
        "after a crash, the op the acquire struck runs side by side with the others",
        (Edit(_SHARD, _SUSPECT, "            if False:\n"),),
        (
            "tests/faults/test_reliability.py::"
            "test_a_poison_op_behind_slow_ops_is_dead_lettered_and_they_are_not" + _STANDALONE,
        ),
    ),
    Mutant(
        "holds-during-replay",
        "G5.2",
        "another shard's in-process op may hold keys while a new owner still replays",
        (
            Edit(_SHARD, "        await self._replay.over.wait()\n", ""),
            Edit(_SHARD, " or not self._replay.over.is_set():\n", ":\n"),
        ),
        (
            _RACES
            + "test_a_participant_takeover_lets_no_in_process_op_overtake_a_replayed_grant"
            + _STANDALONE,
            _RACES
            + "test_an_in_process_op_waits_for_a_replay_of_its_keys_earlier_ops"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-skips-fetched-entries",
        "G3.1",
        "a new owner starts after the entries its dead predecessor fetched, as if committed",
        (
            Edit(
                "keyserial/_worker/runner.py",
                "        self._cursor = grant.progress\n",
                "        self._cursor = grant.replay_until or grant.progress\n",
            ),
        ),
        (
            "tests/faults/test_faults.py::"
            "test_kill_9_of_the_owner_under_load_moves_the_shard_within_a_lease_ttl" + _STANDALONE,
        ),
    ),
    Mutant(
        "acquire-ignores-attempt",
        "G1.3",
        "acquire.lua re-grants an old grant to any attempt of the lease's holder",
        (
            Edit(
                "keyserial/_scripts/lua/acquire.lua",
                "    if granted[1] == ARGV[4] then\n",
                "    if true then\n",
            ),
        ),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_an_acquire_sent_again_by_its_owner_returns_the_same_grant_and_no_strike"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "acquire-unconfirmed",
        "G4.10",
        "with durable_replicas, a worker serves a shard under a grant its replicas lack",
        (
            Edit(
                "keyserial/_worker/leases.py",
                "if isinstance(reply, LeaseGrant) and not confirmed:\n",
                "if isinstance(reply, LeaseGrant) and False:\n",
            ),
        ),
        (
            "tests/faults/test_durability.py::"
            "test_a_worker_runs_no_op_under_an_epoch_its_replica_has_not_confirmed",
        ),
    ),
    Mutant(
        "push-taken-anywhere",
        "G3.7",
        "a worker takes a pushed entry whatever its place, skipping what lies between",
        (Edit("keyserial/_worker/wakeups.py", "if pushed.place > self.next_place:", "if False:"),),
        ("tests/worker/test_wakeups.py::test_a_push_that_does_not_follow_on_is_left_to_a_fetch",),
    ),
    Mutant(
        "push-unconfirmed",
        "G3.8",
        "step.lua commits what ran a pushed entry without confirming it in the stream",
        (Edit(_STEP, "  if problem then\n", "  if false then\n"),),
        (
            _PUSH + "test_a_forged_push_is_run_but_never_committed" + _STANDALONE,
            _PUSH
            + "test_a_push_that_claims_a_place_far_past_the_inbox_is_never_taken"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "push-item-unchecked",
        "G3.8",
        "step.lua confirms a pushed item whatever the inbox holds in its place",
        (Edit(_STEP, "    if held[i] ~= pushed[i] then\n", "    if false then\n"),),
        (_PUSH + "test_a_push_that_marks_a_real_item_fresh_is_never_committed" + _STANDALONE,),
    ),
    Mutant(
        "message-taken-as-is",
        "G5.12",
        "a worker takes a grant or decision message from Redis as it is, not from its record",
        (
            Edit(
                "keyserial/_worker/crossshard/mailbox.py",
                "            else:\n"
                "                for waiter in self._waiting.get(_topic(message), ()):\n"
                "                    waiter.wake()\n",
                "            else:\n                self.deliver(message)\n",
            ),
        ),
        (
            _HOSTILE + "test_a_forged_decision_notice_never_writes_a_state" + _STANDALONE,
            _HOSTILE + "test_a_forged_grant_never_reaches_the_ops_state" + _STANDALONE,
        ),
    ),
    Mutant(
        "resolve-aborts-ahead",
        "G5.13",
        "resolve.lua aborts an attempt that has not begun",
        (Edit("keyserial/_scripts/lua/resolve.lua", "if epoch < attempt then", "if false then"),),
        (_HOSTILE + "test_a_grant_request_for_an_attempt_not_begun_aborts_nothing" + _STANDALONE,),
    ),
    Mutant(
        "acquire-publishes-poison",
        "G6.18",
        "acquire.lua publishes the dead-letter reply itself, ahead of any confirmation",
        (
            Edit(
                "keyserial/_scripts/lua/acquire.lua",
                "    'reason', 'poison: killed its worker ' .. strikes .. ' times', 'raw',"
                " envelope_json(envelope))\n",
                "    'reason', 'poison: killed its worker ' .. strikes .. ' times', 'raw',"
                " envelope_json(envelope))\n"
                "  if type(envelope.reply) == 'string' then\n"
                "    redis.call('PUBLISH', envelope.reply, '{\"v\":1,\"r\":[[' .."
                " cjson.encode(envelope.id) .. ',' .. outcome .. ']]}')\n"
                "  end\n",
            ),
        ),
        (
            "tests/operator/test_dead_letters.py::"
            "test_the_acquire_that_dead_letters_an_op_publishes_no_reply" + _STANDALONE,
        ),
    ),
    Mutant(
        "unknown-op-unrecorded",
        "G6.17",
        "a takeover counts an op answered without a stored outcome as unfinished",
        (
            Edit(
                "keyserial/_scripts/lua/acquire.lua",
                " and not finished(envelope.id .. '#u') then",
                " then",
            ),
        ),
        (
            "tests/operator/test_dead_letters.py::"
            "test_an_unknown_op_beside_a_poison_op_is_never_struck_twice_nor_dead_lettered"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "op-ids-counted",
        "G3.9",
        "a client's op ids are its id and a counter, as anyone who saw one can tell the next",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                'return f"{self._client_id}-{next(self._count):x}{self._random.pop()}"',
                'return f"{self._client_id}-{next(self._count)}"',
            ),
        ),
        (
            _HOSTILE
            + "test_ops_appended_under_a_client_s_guessed_next_ids_never_answer_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "release-by-anyone",
        "G1.4",
        "release.lua frees the lease whoever holds it",
        (Edit(_RELEASE_LUA, "if redis.call('GET', KEYS[1]) ~= ARGV[1] then", "if false then"),),
        (
            _LEASE
            + "test_a_zombie_s_release_leaves_the_new_owner_s_lease_and_epoch_alone"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "renew-by-anyone",
        "G1.4",
        "renew.lua extends the lease whoever holds it",
        (
            Edit(
                "keyserial/_scripts/lua/renew.lua",
                "if redis.call('GET', KEYS[1]) == ARGV[1] then",
                "if true then",
            ),
        ),
        (
            _LEASE
            + "test_a_zombie_s_renewal_is_told_it_no_longer_owns_and_extends_nothing"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "release-keeps-epoch",
        "G1.4",
        "release.lua leaves the epoch where it is: the releasing owner's late writes land",
        (Edit(_RELEASE_LUA, "redis.call('INCR', KEYS[6])\n", ""),),
        (_LEASE + "test_a_step_that_lands_after_its_owner_s_release_is_fenced" + _STANDALONE,),
    ),
    Mutant(
        "sweep-one-lookup",
        "G6.10",
        "the client's sweep appends an op again without looking its outcome up a second time",
        (
            Edit(
                "keyserial/_client/sweep.py",
                "still = await self._outcomes.settle(keys, list(gone))",
                "still = list(gone)",
            ),
        ),
        (
            "tests/client/test_lost_replies.py::"
            "test_an_op_that_commits_between_the_sweep_s_lookups_is_never_appended_again"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sweep-appends-expired",
        "G6.20",
        "the client's sweep appends again an op whose outcome may have expired",
        (
            Edit(
                "keyserial/_client/sweep.py",
                "        if waited < self._settings.result_ttl:\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/client/test_lost_replies.py::"
            "test_an_op_gone_with_no_outcome_after_result_ttl_fails_and_is_not_appended_again"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "step-stores-outcome-twice",
        "G3.10",
        "step.lua stores an op's outcome over one already stored",
        (Edit(_STEP, "  if #stored > 0 then\n", "  if false then\n"),),
        (
            _HOSTILE + "test_an_op_appended_again_as_fresh_never_runs_twice[standalone-fetched]",
            _HOSTILE + "test_an_op_appended_again_as_fresh_never_runs_twice[standalone-pushed]",
        ),
    ),
    Mutant(
        "step-others-replay-landed",
        "G3.10",
        "step.lua takes a step as sent again when its other shards' writes do not hold",
        (
            Edit(
                _STEP,
                "    if owns_other(other[1], other[2]) and not writes_hold(",
                "    if false and not writes_hold(",
            ),
        ),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_step_writing_another_shard_of_an_op_run_again_is_refused_and_writes_nothing"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "hold-released-only-by-a-new-commit",
        "G5.18",
        "step.lua deletes a hold only when it commits, not when it takes the step as sent again",
        (Edit(_STEP, "if ARGV[6] == '1' then\n  multi('HDEL'", "if commit then\n  multi('HDEL'"),),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_hold_lasts_until_the_step_that_answers_its_request" + _STANDALONE,
        ),
    ),
    Mutant(
        "hold-recorded-after-its-answer",
        "G5.18",
        "step.lua records a hold for an attempt whose part here is over (its outcome stored)",
        (
            Edit(
                _STEP, "    if has_outcome(KEYS[5], KEYS[6], ARGV[i]) then\n", "    if false then\n"
            ),
        ),
        (
            _IDEMPOTENT
            + "test_a_hold_of_an_attempt_whose_part_is_over_is_skipped_and_named_in_the_reply"
            "[results-standalone]",
            _IDEMPOTENT + "test_a_hold_lasts_until_the_step_that_answers_its_request" + _STANDALONE,
        ),
    ),
    Mutant(
        "hold-skip-reads-one-generation",
        "G5.18",
        "step.lua records a hold for an attempt whose outcome is in the previous results"
        " generation",
        (
            Edit(
                _STEP,
                "    if has_outcome(KEYS[5], KEYS[6], ARGV[i]) then\n",
                "    if has_outcome(KEYS[5], KEYS[5], ARGV[i]) then\n",
            ),
        ),
        (
            _IDEMPOTENT
            + "test_a_hold_of_an_attempt_whose_part_is_over_is_skipped_and_named_in_the_reply"
            "[results_old-standalone]",
        ),
    ),
    Mutant(
        "step-replay-ignores-deletes",
        "G3.10",
        "step.lua takes a step as sent again when a key it deletes is there",
        (
            Edit(
                _STEP,
                "    if redis.call('HEXISTS', hash, ARGV[i]) == 1 then\n",
                "    if false then\n",
            ),
        ),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_step_whose_delete_no_longer_holds_is_not_taken_for_itself_sent_again"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "decision-over-abort",
        "G5.2",
        "step.lua records a coordinator's decision over an abort a participant recorded first",
        (Edit(_STEP, "    if earlier and earlier ~= ARGV[i + 1] then", "    if false then"),),
        (
            "tests/backend/test_scripts_idempotent.py::test_a_decision_never_wins_over_an_abort"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "op-id-unbound",
        "G3.11",
        "a stored outcome answers any op appended under its op id",
        (
            Edit(
                "keyserial/_worker/intake.py",
                "        if envelope is not None and binding_of(stored)"
                " not in (None, binding(envelope) or None):",
                "        if False:",
            ),
        ),
        (
            "tests/wire/test_wire_format.py::"
            "test_another_op_under_a_used_op_id_is_refused_by_the_worker" + _STANDALONE,
        ),
    ),
    Mutant(
        "op-id-joins-any-run",
        "G3.11",
        "an op appended under the id of a running op joins that run, whatever it is",
        (
            Edit(
                "keyserial/_worker/intake.py",
                "    elif envelope is not None and binding(run.envelope) != binding(envelope):",
                "    elif False:",
            ),
        ),
        (
            _HOSTILE
            + "test_an_op_appended_ahead_under_a_callers_op_id_never_answers_the_caller"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "result-ignores-the-op",
        "G3.11",
        "result(op_id, key=..., op=...) returns whatever outcome is stored under the id",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                "        if bound_to is not None:\n            outcome = own_outcome(",
                "        if False:\n            outcome = own_outcome(",
            ),
        ),
        (
            "tests/client/test_submit.py::"
            "test_result_given_the_op_checks_a_multi_key_op_s_binding_too" + _STANDALONE,
        ),
    ),
    Mutant(
        "submit-times-out-early",
        "G7.11",
        "a submit's deadline is rounded down to its slice, so it may time out before its timeout",
        (
            Edit(
                "keyserial/_client/pending.py",
                "at = math.ceil((self._loop.time() + seconds) / DEADLINE_SLICE)",
                "at = math.floor((self._loop.time() + seconds) / DEADLINE_SLICE)",
            ),
        ),
        (
            "tests/client/test_deadlines.py::"
            "test_a_deadline_never_fires_early_and_a_discarded_one_never_fires",
        ),
    ),
    Mutant(
        "ops-per-second-since-any-viewer",
        "G8.5",
        "a shard's ops/s is taken since the last snapshot, however little time ago",
        (
            Edit(
                "keyserial/_operator/status.py",
                "        while len(self._kept) > 1 and at - self._kept[1][0].time_ms"
                " >= RATE_WINDOW_MS:",
                "        while len(self._kept) > 1:",
            ),
        ),
        (
            "tests/operator/test_status.py::"
            "test_ops_per_second_is_taken_over_at_least_a_second_whoever_asked_last",
        ),
    ),
    Mutant(
        "service-ignored",
        "G8.13",
        "a client's reply channel leaves its service out",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                'client_id = f"{settings.service}.{random_id}" if settings.service else random_id',
                "client_id = random_id",
            ),
        ),
        (
            "tests/security/test_acl.py::"
            "test_a_service_user_serves_its_clients_and_cannot_reach_another_services_replies"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "client-trusts-replies",
        "G8.14",
        "a client takes a reply message's outcome as its op's",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                "            if not self.settings.verify_replies:",
                "            if True:",
            ),
        ),
        (_HOSTILE + "test_a_forged_reply_never_answers_a_caller" + _STANDALONE,),
    ),
    Mutant(
        "reply-signature-unchecked",
        "G8.14",
        "a client takes a reply as signed whatever its tag",
        (
            Edit(
                "keyserial/_wire/signing.py",
                "        if not hmac.compare_digest("
                "_tag(key, channel or self.channel, signed), tag):",
                "        if False:",
            ),
        ),
        ("tests/security/test_signing.py::test_a_signed_reply_verifies_on_its_own_channel_only",),
    ),
    Mutant(
        "signed-reply-of-any-entry-taken",
        "G8.14",
        "a client takes a signed reply's outcome whichever entry it answered",
        (
            Edit(
                "keyserial/_client/outcomes.py",
                "        or pending.entry.place not in entries\n    ):",
                "        or False\n    ):",
            ),
        ),
        (_HOSTILE + "test_a_signed_reply_replayed_for_a_resubmit_never_answers_it" + _STANDALONE,),
    ),
    Mutant(
        "answer-of-any-entry-taken",
        "G8.14",
        "a client takes an op id's recorded UnknownOperation whichever entry it answered",
        (
            Edit(
                "keyserial/_client/outcomes.py",
                "    if pending.entry is None or pending.entry.place not in entries:",
                "    if not entries:",
            ),
        ),
        (
            _HOSTILE
            + "test_a_refusal_recorded_for_an_earlier_entry_never_answers_a_resubmit"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "stream-stays-exhausted",
        "G3.12",
        "step.lua leaves a stream whose last id is the largest as it is",
        (Edit(_STEP, "if ARGV[2] == LARGEST_ID or (", "if false or ("),),
        (
            _INBOX
            + "test_an_entry_under_the_largest_id_holds_pushed_ops_only_until_it_has_committed"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "range-after-the-largest-id",
        "G3.12",
        "lib.lua's xrange_after asks Redis for the entries after the largest id (an error)",
        (Edit(_LUA + "lib.lua", "  if after == LARGEST_ID then\n", "  if false then\n"),),
        (
            _LEASE
            + "test_nothing_is_fetched_or_replayed_after_the_largest_id_and_nothing_fails"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "emptied-stream-stays-exhausted",
        "G3.12",
        "a stream emptied after an entry under the largest id is never started again",
        (
            Edit(
                _STEP,
                "if ARGV[2] == LARGEST_ID or (ARGV[4] == LARGEST_ID and"
                " redis.call('XLEN', KEYS[4]) == 0) then\n",
                "if ARGV[2] == LARGEST_ID then\n",
            ),
        ),
        (
            _LEASE
            + "test_a_stream_emptied_after_an_entry_under_the_largest_id_starts_again"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "strays-read-after-the-largest-id",
        "G3.12",
        "entries_since asks Redis for the entries after the largest id (an error)",
        (
            Edit("keyserial/_backend/backend.py", "if cursor != LARGEST_ID]", "if cursor]"),
            Edit(
                "keyserial/_backend/backend.py",
                "[[] if cursor == LARGEST_ID else _entries(next(found))",
                "[_entries(next(found))",
            ),
        ),
        (_RESHARD + "test_strays_are_read_after_every_cursor_but_the_largest_id" + _STANDALONE,),
    ),
    Mutant(
        "oom-refused-for-good",
        "G6.21",
        'an OOM error reply is a refusal that no retry cures, not a "not now"',
        (
            Edit(
                "keyserial/_backend/transport.py",
                "    redis_errors.AskError,\n    redis_errors.OutOfMemoryError,\n",
                "    redis_errors.AskError,\n",
            ),
            Edit(
                "keyserial/_backend/transport.py",
                '    "UNBLOCKED",\n    "OOM ",\n    "MISCONF ",\n',
                '    "UNBLOCKED",\n',
            ),
        ),
        (
            "tests/faults/test_reliability.py::test_a_server_out_of_memory_is_waited_out_and_blames_no_op",
        ),
    ),
    Mutant(
        "busy-state-evicted",
        "G2.7",
        "the state cache drops a key that a queued or running op still needs",
        (
            Edit(
                "keyserial/_worker/keystates.py",
                "            if key not in waiting and not busy(key):\n",
                "            if key not in waiting:\n",
            ),
        ),
        (
            "tests/worker/test_state_cache.py::test_a_key_an_op_still_needs_is_never_dropped"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "op-sets-never-compared",
        "G8.16",
        "workers of the same shards with different op sets pass for the same",
        (
            Edit(
                "keyserial/_wire/roster.py",
                " or set(other.ops) == set(mine.ops):",
                " or True:",
            ),
        ),
        (
            "tests/operator/test_status.py::test_status_lists_standby_workers_and_workers_whose_ops_differ"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "enqueue-waits-for-the-op",
        "G7.17",
        "enqueue returns only once the op has run, as submit does",
        (
            Edit(
                "keyserial/_client/pending.py",
                "        if self.appended_only:\n            self.settle(APPENDED)\n",
                "",
            ),
        ),
        (
            "tests/client/test_enqueue.py::"
            "test_an_enqueued_op_returns_once_appended_and_runs_when_a_worker_comes" + _STANDALONE,
        ),
    ),
    Mutant(
        "dev-gives-up-on-a-dead-worker",
        "G8.18",
        "keyserial dev stops when its worker dies instead of starting another",
        (Edit("keyserial/cli/dev.py", "            if code == 2:\n", "            if True:\n"),),
        (
            "tests/operator/test_cli.py::"
            "test_dev_restarts_a_worker_an_op_killed_and_leaves_no_server_when_killed",
        ),
    ),
    Mutant(
        "outage-warns-every-retry",
        "G8.19",
        "every retry during a Redis outage logs its own warning",
        (
            Edit(
                "keyserial/_backend/outage.py",
                "        if self.since is None:\n            self.since",
                "        if True:\n            self.since",
            ),
        ),
        (
            "tests/worker/test_logging.py::"
            "test_an_outage_of_redis_is_logged_once_per_process_side_and_once_when_it_ends",
        ),
    ),
    Mutant(
        "second-signal-keeps-draining",
        "G6.7",
        "a second SIGTERM or SIGINT while a worker drains changes nothing",
        (
            Edit(
                "keyserial/cli/serving.py",
                "                        worker.stop(at_once=True)\n",
                "                        pass\n",
            ),
        ),
        (
            "tests/operator/test_cli.py::test_a_second_signal_stops_at_once_and_still_releases_the_leases"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "grant-of-other-keys-taken",
        "G5.16",
        "a coordinator takes a grant recorded under its attempt's id whatever keys it holds",
        (
            Edit(
                _COORDINATOR,
                "        if sorted(key for key, _ in grant.states) == sorted(keys):",
                "        if True:",
            ),
        ),
        (
            _HOSTILE
            + "test_a_signed_grant_request_ahead_for_other_keys_never_decides_the_op"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "grant-before-outcome",
        "G5.14",
        "a participant grants a key while the outcome of the op before it is not committed",
        (
            Edit(
                "keyserial/_worker/keystates.py",
                "        self._answered.update(keys)\n",
                "        pass\n",
            ),
        ),
        (
            "tests/worker/test_wakeups.py::"
            "test_an_op_that_wrote_nothing_keeps_its_keys_uncommitted_until_a_step_took_it",
        ),
    ),
    Mutant(
        "push-names-a-wrong-place",
        "G3.7",
        "submit.lua's push names the inbox's next place, whatever stood ahead of the entry",
        (Edit(_LUA + "submit.lua", "or '0') + ahead + 1", "or '0') + 1"),),
        (
            _PUSH + "test_a_fresh_entry_is_pushed_with_its_place_in_the_inbox" + _STANDALONE,
            _PUSH
            + "test_an_entry_pushed_without_a_wake_up_is_never_skipped_by_a_push"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "push-taken-unrecorded",
        "G3.7",
        "a worker takes pushes before any step of its has recorded that it does",
        (
            Edit(
                "keyserial/_worker/wakeups.py",
                "return bool(want) and not replaying and not self.recorded",
                "self.recorded = True\n        return False",
            ),
        ),
        (
            _PUSH + "test_a_worker_records_that_it_takes_pushes_before_it_takes_any" + _STANDALONE,
            _PUSH + "test_a_pushed_op_that_kills_its_worker_is_struck_at_every_death" + _STANDALONE,
        ),
    ),
    Mutant(
        "step-forgets-push",
        "G3.7",
        "step.lua leaves the horizon below an entry its owner took in from a push",
        (Edit(_STEP, "if #entries == 0 and last_kept then", "if false then"),),
        (
            _PUSH
            + "test_a_step_moves_the_pushed_entries_in_and_raises_the_horizon_to_them"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-forgets-push",
        "G3.7",
        "acquire.lua does not count the entries an owner that took pushes may have run",
        (
            Edit(
                "keyserial/_scripts/lua/acquire.lua",
                "if redis.call('GET', KEYS[13]) == tostring(epoch - 1) then",
                "if false then",
            ),
        ),
        (
            _PUSH
            + "test_a_takeover_counts_every_entry_as_fetched_if_the_dead_owner_took_pushes"
            + _STANDALONE,
            _PUSH + "test_a_pushed_op_that_kills_its_worker_is_struck_at_every_death" + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-suspects-unpushed",
        "G3.7",
        "acquire.lua counts every entry as fetched, also from an owner that took no pushes",
        (
            Edit(
                "keyserial/_scripts/lua/acquire.lua",
                "if redis.call('GET', KEYS[13]) == tostring(epoch - 1) then",
                "if true then",
            ),
        ),
        (
            _PUSH + "test_a_takeover_from_an_owner_that_took_no_pushes_suspects_only_what_it_"
            "fetched" + _STANDALONE,
        ),
    ),
    Mutant(
        "reshard-skips-the-copy",
        "G11.1",
        "the mover flips without copying the old shards' states to the new ones",
        (
            Edit(
                "keyserial/_reshard/mover.py",
                '        raise_errors(await backend.pipeline(commands))\n    progress(f"copied',
                '        pass\n    progress(f"copied',
            ),
        ),
        (_RESHARD + "test_a_namespace_grows_and_shrinks_under_load_losing_nothing" + _STANDALONE,),
    ),
    Mutant(
        "reshard-trusts-fresh-across-layouts",
        "G11.4",
        "a new layout's owner skips looking up earlier layouts' outcomes of ops marked fresh",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "trust_fresh=self._in_step and not replaying",
                "trust_fresh=not replaying",
            ),
        ),
        (_RESHARD + "test_an_op_copied_as_fresh_into_the_new_layout_never_runs_twice[cluster]",),
    ),
    Mutant(
        "reshard-trusts-fresh-while-replaying",
        "G11.4",
        "a new layout's owner, replaying after a step refused for an earlier layout's outcome,"
        " still skips looking up ops marked fresh there",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "trust_fresh=self._in_step and not replaying",
                "trust_fresh=self._in_step",
            ),
        ),
        (
            _RESHARD
            + "test_an_op_copied_as_fresh_into_the_new_layout_never_runs_twice"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "step-checks-no-earlier-layout",
        "G11.4",
        "a new layout's owner skips the lookup of fresh ops and its step does not make it either",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "        if not self._in_step or not self._history:\n            return []",
                "        if True:\n            return []",
            ),
        ),
        (
            _RESHARD
            + "test_an_op_copied_as_fresh_into_the_new_layout_never_runs_twice"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "step-ignores-earlier-layouts",
        "G11.4",
        "step.lua commits an op whose outcome a layout before a reshard stored",
        (_no_fence(_STEP, "if commit and ARGV[15] and ARGV[15] ~= '' then"),),
        (
            "tests/backend/test_scripts_idempotent.py::"
            "test_a_step_storing_an_outcome_stored_in_an_earlier_layout_is_refused[results-standalone]",
            _RESHARD
            + "test_an_op_copied_as_fresh_into_the_new_layout_never_runs_twice"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-shard-forwards-pushes",
        "G11.4",
        "a sealed shard takes pushes in and forwards their ops before any step confirmed them",
        (
            Edit(
                "keyserial/_worker/runner.py",
                "        if self.sealed:\n            self.entries_waiting()\n            return\n",
                "",
            ),
            Edit(
                "keyserial/_worker/runner.py",
                " or self._replay.replaying or self.sealed:",
                " or self._replay.replaying:",
            ),
            Edit(
                "keyserial/_worker/draining.py",
                "        if from_stream and self.past_seal(entry_id):",
                "        if self.past_seal(entry_id):",
            ),
        ),
        (_RESHARD + "test_a_forged_push_to_a_sealed_shard_is_never_forwarded" + _STANDALONE,),
    ),
    Mutant(
        "retired-shard-strays-stay",
        "G11.4",
        "nobody forwards ops appended to an old shard after the flip: they wait there, never run",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "self.settings, record, self._owned.__contains__",
                "self.settings, record, lambda shard: False",
            ),
        ),
        (
            _RESHARD
            + "test_an_op_pushed_with_a_plain_rpush_to_a_retired_shard_is_forwarded_and_runs_once"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "stale-appends-stall-the-move",
        "G11.2",
        "the mover counts an old shard as draining while any entry follows its drained record",
        (
            Edit(
                _MOVER,
                "    return parse_id(through) >= parse_id(Seal.decode(keys.namespace,"
                " shard.sealed).last)\n",
                "    return parse_id(through) >= parse_id(shard.last_id)\n",
            ),
        ),
        (
            _RESHARD
            + "test_a_move_finishes_while_a_stale_client_keeps_appending_to_an_old_shard"
            + _STANDALONE,
            _RESHARD
            + "test_the_mover_counts_strays_past_the_seal_as_drained_however_many"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-ignores-the-seal",
        "G11.4",
        "a runner that takes a sealed shard over runs what follows the seal until its poll",
        (Edit("keyserial/_worker/runner.py", "            await self._read_seal()\n", ""),),
        (
            _RESHARD
            + "test_a_worker_that_takes_a_sealed_shard_over_forwards_what_follows_the_seal"
            + _STANDALONE,
            _RESHARD
            + "test_a_worker_that_takes_a_sealed_idle_shard_over_forwards_a_push_past_the_seal"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "drain-waits-for-deleted-entries",
        "G11.2",
        "a sealed shard counts as drained only once its cursor reaches the seal's entry",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "        return seal.last if self.fetched_all else None\n",
                "        return None\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_old_shard_drains_when_the_entries_before_its_seal_are_gone"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "read-trails-the-cut",
        "G11.1",
        "a client that knows of a move under way reads the old layout, frozen at the cut",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                "        raw = await self._state_in(self._routes.routing, key)\n",
                "        raw = await self._state_in(self._routes.live, key)\n",
            ),
        ),
        (_RESHARD + "test_a_client_reads_its_own_write_across_the_cut" + _STANDALONE,),
    ),
    Mutant(
        "serves-before-its-signer-is-listed",
        "G5.17",
        "a worker takes its shards before its signer is listed: participants refuse its requests",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "                await task_group.start(self._keep_signer_listed, backend)\n",
                "                task_group.start_soon(self._keep_signer_listed, backend)\n",
            ),
        ),
        (_GRANTS + "test_a_worker_serves_no_shard_before_its_signer_is_listed" + _STANDALONE,),
    ),
    Mutant(
        "grant-request-unsigned-taken",
        "G5.17",
        "a worker takes a grant request from any message on its channel, signed for it or not",
        (
            Edit(
                "keyserial/_worker/crossshard/mailbox.py",
                "                if signed is not None:\n"
                "                    self.take_request(message)\n",
                "                if True:\n                    self.take_request(message)\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_request_is_taken_only_from_a_message_a_listed_worker_signed_for_this_one"
            "[standalone-unsigned]",
        ),
    ),
    Mutant(
        "grant-request-any-shard",
        "G5.17",
        "a participant takes a grant request for another shard or layout generation",
        (_no_check(_PARTICIPANT, "    if request.target != name:\n"),),
        (
            _GRANTS
            + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-another-generation]",
        ),
    ),
    Mutant(
        "grant-request-any-home",
        "G5.17",
        "a participant takes a grant request from a home shard not below it, or under an op id"
        " holding '#'",
        (
            _no_check(
                _PARTICIPANT, '    if not 0 <= request.home < shard or "#" in request.op_id:\n'
            ),
        ),
        (
            _GRANTS + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-home-itself]",
            _GRANTS + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-home-above]",
            _GRANTS
            + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-hash-in-op-id]",
        ),
    ),
    Mutant(
        "grant-request-keys-anywhere",
        "G5.17",
        "a participant takes a grant request naming keys that route to other shards",
        (
            _no_check(
                _PARTICIPANT,
                "    if any(shard_for(key, shard_count) != shard for key in request.keys):\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-keys-elsewhere]",
        ),
    ),
    Mutant(
        "grant-request-any-age",
        "G5.17",
        "a participant takes a grant request made more than half of result_ttl ago, or ahead",
        (
            _no_check(
                _PARTICIPANT, "    if abs(time.time() * 1000 - request.at) > result_ttl_ms / 2:\n"
            ),
        ),
        (
            _GRANTS + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-too-old]",
            _GRANTS
            + "test_a_signed_request_that_breaks_a_rule_is_dropped[standalone-from-the-future]",
        ),
    ),
    Mutant(
        "grant-request-held-twice",
        "G5.17",
        "a participant takes a grant request again while its attempt's run is under way",
        (
            Edit(
                _SHARD,
                "            self._cross.request_again(run, request)\n            return\n",
                "            pass\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_request_replayed_while_its_attempt_is_held_is_ignored"
            + "[standalone-replayed]",
        ),
    ),
    Mutant(
        "refused-copy-ends-the-run",
        "G5.17",
        "the refusal of a copy appended under a running grant request's id ends that run in"
        " memory: the request sent again is held a second time (a lent grant is never sent"
        " again)",
        (
            Edit(
                _SHARD,
                "            if finished.run is not None and self._running.get(finished.op_id)"
                " is finished.run:\n",
                "            if self._running.get(finished.op_id) is not None:\n",
            ),
        ),
        (
            _GRANTS
            + "test_a_request_replayed_while_its_attempt_is_held_is_ignored"
            + "[standalone-copy refused first]",
        ),
    ),
    Mutant(
        "dashboard-replay-without-token",
        "G8.29",
        "the dashboard replays a dead letter for a request without its token",
        (_token_unchecked_on("replay"),),
        (_TOKEN_TEST,),
    ),
    Mutant(
        "dashboard-resume-without-token",
        "G8.29",
        "the dashboard resumes a paused key for a request without its token",
        (_token_unchecked_on("resume"),),
        (_TOKEN_TEST,),
    ),
    Mutant(
        "reshard-copies-dead-letters-twice",
        "G11.5",
        "a rerun of the mover copies again the dead letters an interrupted run had copied",
        (
            Edit(
                "keyserial/_reshard/mover.py",
                "if (origin := _origin(old, letter_id)) not in copied",
                "if (origin := _origin(old, letter_id)) not in set()",
            ),
        ),
        (
            _RESHARD
            + "test_a_mover_interrupted_mid_dead_letters_lists_each_letter_once_after_its_rerun"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "reshard-prunes-by-its-own-ttl",
        "G11.3",
        "the flip prunes the history by the mover's result_ttl alone, not the workers'",
        (
            Edit(
                "keyserial/_reshard/mover.py",
                "    retention = await _longest_retention(backend, settings)\n",
                "    retention = settings.result_ttl\n",
            ),
        ),
        (
            _RESHARD
            + "test_a_reshard_keeps_old_layouts_as_long_as_the_workers_keep_results"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "mover-flips-over-holds",
        "G11.2",
        "the mover counts an old shard drained while it holds keys for another shard's op",
        (
            Edit(
                _MOVER,
                "    if not shard.sealed or through is None or shard.held:\n",
                "    if not shard.sealed or through is None:\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_old_shard_holding_keys_for_another_shard_s_op_is_not_drained"
            + _STANDALONE,
            _RESHARD
            + "test_the_mover_never_flips_while_an_old_shard_holds_keys_for_another_shard_s_op"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-runner-counts-forwards-as-work",
        "G11.2",
        "a sealed shard's owner records it drained only with no forward in flight",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "            and all(op_id in forwarded for op_id in running)\n",
                "            and not running\n",
            ),
        ),
        (
            _RESHARD
            + "test_a_stale_client_packing_entries_faster_than_they_are_forwarded_holds_no_move_up"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "mover-flips-after-one-reading",
        "G11.2",
        "the mover ends the drain after one reading that finds every old shard drained",
        (
            Edit(
                _MOVER,
                "        if not busy and work == self._previous:\n",
                "        if not busy:\n",
            ),
        ),
        (_RESHARD + "test_the_drain_ends_only_after_two_readings_in_a_row_find_the_same_work",),
    ),
    Mutant(
        "sealed-shard-stores-refusals-past-the-seal",
        "G11.4",
        "a sealed shard stores the refusal of an op appended past its seal",
        (
            Edit(
                _SHARD,
                "                finished.store = finished.store and not past_seal"
                "  # (replied only: see there)\n",
                "",
            ),
        ),
        (
            _RESHARD
            + "test_an_outcome_stored_past_a_seal_never_answers_an_op_of_the_new_layout"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "signed-reply-of-any-layout-taken",
        "G8.14",
        "a client takes a signed reply's outcome whichever layout generation it answered",
        (
            Edit(
                "keyserial/_client/outcomes.py",
                '        or answer.get("g") != pending.shard.generation\n',
                "",
            ),
        ),
        (_RESHARD + "test_a_reply_of_an_older_layout_never_settles_a_submit" + _STANDALONE,),
    ),
    Mutant(
        "signed-reply-of-any-shard-taken",
        "G8.14",
        "a client takes a signed reply's outcome whichever shard it answered",
        (
            Edit(
                "keyserial/_client/outcomes.py",
                '        or answer.get("s") != pending.shard.shard\n',
                "",
            ),
        ),
        (_HOSTILE + "test_a_signed_reply_of_another_shard_never_settles_a_submit" + _STANDALONE,),
    ),
    Mutant(
        "reply-tag-half-checked",
        "G8.14",
        "a client takes a signed reply whose tag matches in its first half only",
        (
            Edit(
                "keyserial/_wire/signing.py",
                "        if not hmac.compare_digest("
                "_tag(key, channel or self.channel, signed), tag):",
                "        if not hmac.compare_digest("
                "_tag(key, channel or self.channel, signed)[:16], tag[:16]):",
            ),
        ),
        (
            "tests/security/test_signing.py::test_a_signed_reply_is_taken_only_if_its_whole_tag_matches",
        ),
    ),
    Mutant(
        "pause-skips-the-move-target",
        "G11.2",
        "a pause or resume made while a move is under way is written to the live layout only",
        (
            Edit(
                "keyserial/_operator/pauses.py",
                "    if layouts.move is not None:\n"
                "        await backend.set_paused(_shard_keys(layouts.move.target, key),"
                " key, record)\n",
                "",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_a_pause_and_a_resume_between_the_copy_and_the_flip_hold_after_the_flip"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "pause-trusts-a-stale-layout",
        "G11.2",
        "a pause or resume is written by the layout it read, though a move flipped since",
        (
            Edit(
                "keyserial/_operator/pauses.py",
                "        if (again.live, again.move) == (layouts.live, layouts.move):\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_a_pause_and_a_resume_that_read_the_layout_before_a_flip_hold_after_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "mover-copies-paused-keys-once",
        "G11.2",
        "the mover copies the paused keys from one reading, undoing a pause or resume made since",
        (Edit(_MOVER, "        if again == paused:\n", "        if True:\n"),),
        (
            "tests/operator/test_pause.py::"
            "test_a_pause_and_a_resume_made_while_the_mover_copies_paused_keys_hold" + _STANDALONE,
        ),
    ),
    Mutant(
        "step-hides-the-seal",
        "G11.4",
        "an owner that has not heard of its shard's seal runs what a client appended past it",
        (
            Edit(
                _SHARD,
                "        if fetched.sealed is not None and not self.sealed:\n",
                "        if False:\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "reshard-keeps-stale-pauses",
        "G11.2",
        "a rerun of the copy adds the old shards' paused keys but never removes one resumed since",
        (
            Edit(
                _MOVER,
                '        raise_errors(await backend.pipeline([("DEL", keys.paused) for keys in'
                " new_keys]))\n",
                "",
            ),
        ),
        (
            _RESHARD
            + "test_a_rerun_move_leaves_each_key_paused_as_the_operator_last_set_it"
            + _STANDALONE,
            _RESHARD
            + "test_a_resume_between_the_copys_reading_and_its_writes_is_not_undone"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "reshard-drops-pauses",
        "G11.5",
        "the mover copies states but not paused keys: a paused key's ops run on its new shard",
        (
            Edit(
                _MOVER,
                "        raise_errors(await backend.pipeline(commands))\n"
                "        again = await backend.all_paused(old_keys)\n",
                "        again = await backend.all_paused(old_keys)\n",
            ),
        ),
        (_RESHARD + "test_a_reshard_carries_a_paused_key" + _STANDALONE,),
    ),
    Mutant(
        "step-hides-the-pauses",
        "G8.26",
        "an owner that has not heard of a pause runs the paused key's ops it fetches",
        (
            Edit(
                _SHARD,
                "        if fetched.paused is not None and fetched.paused != self._paused.keys()"
                ":\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_an_owner_that_has_not_heard_of_a_pause_holds_the_key_it_fetches" + _STANDALONE,
        ),
    ),
    Mutant(
        "default-url-on-the-standard-port",
        "G8.32",
        "with no URL given, clients and commands go to redis://127.0.0.1:6379/0 again",
        (
            Edit(
                "keyserial/_settings.py",
                'DEFAULT_URL = f"redis://127.0.0.1:{DEV_PORT}/0"\n',
                'DEFAULT_URL = "redis://127.0.0.1:6379/0"\n',
            ),
        ),
        (_DEFAULT + "test_no_url_means_the_server_keyserial_dev_starts",),
    ),
    Mutant(
        "commands-name-no-server",
        "G8.32",
        "a command whose command line names no server uses one without a word",
        (Edit("keyserial/cli/__init__.py", "        _name_the_server(args)\n", "        pass\n"),),
        (_DEFAULT + "test_every_command_names_its_server_unless_its_command_line_does",),
    ),
    Mutant(
        "worker-logs-no-server",
        "G8.32",
        "a worker serves without logging which Redis it uses",
        (
            Edit(
                "keyserial/cli/serving.py",
                '    log.info("worker using Redis at %s (%s)", redact(url), chosen_by)\n',
                "",
            ),
        ),
        (_DEFAULT + "test_the_worker_logs_the_server_it_serves_before_it_serves",),
    ),
    Mutant(
        "timeout-names-no-server",
        "G7.18",
        "a submit timing out for want of a worker does not say on which server",
        (
            Edit(
                "keyserial/_client/asyncio_client.py", "            server=self._backend.url,\n", ""
            ),
        ),
        (
            _DEFAULT + "test_a_timeout_for_want_of_a_worker_names_the_server_password_hidden",
            _DEFAULT + "test_call_says_which_server_has_no_worker_for_its_shard",
        ),
    ),
    Mutant(
        "stale-shard-count-refused",
        "G11.7",
        "a client given the shard count from before a reshard is refused after it",
        (
            Edit(
                "keyserial/_client/connect.py",
                "        if record is None or not resharded(record):\n",
                "        if True:\n",
            ),
        ),
        (
            _STALE + "test_a_count_from_before_a_reshard_connects_warns_and_routes_by_the_new_one",
            _STALE + "test_the_count_a_move_under_way_goes_to_is_taken_without_a_word",
        ),
    ),
    Mutant(
        "any-shard-count-taken",
        "G11.7",
        "a shard count a never-resharded namespace does not have is taken",
        (
            Edit(
                "keyserial/_client/connect.py",
                "        if record is None or not resharded(record):\n",
                "        if record is None:\n",
            ),
        ),
        (_STALE + "test_the_count_a_move_under_way_goes_to_is_taken_without_a_word",),
    ),
    Mutant(
        "reader-gone-traceback",
        "G8.33",
        "output to a reader that has gone ends in a BrokenPipeError traceback",
        (
            Edit(
                "keyserial/cli/__init__.py",
                "    except BrokenPipeError:\n        return _reader_gone()\n",
                "    except ZeroDivisionError:\n        return _reader_gone()\n",
            ),
            Edit(
                "keyserial/cli/__init__.py",
                "        if _found(exc, BrokenPipeError) is not None:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/operator/test_cli.py::test_a_reader_gone_ends_a_command_quietly_as_sigpipe_would[status]",
        ),
    ),
    Mutant(
        "status-hides-paused-keys",
        "G8.34",
        "status.lua reads no paused keys",
        (
            Edit(
                "keyserial/_scripts/lua/status.lua",
                "  redis.call('HGETALL', KEYS[8]),\n",
                "  {},\n",
            ),
        ),
        (
            "tests/operator/test_status.py::"
            "test_status_shows_each_shard_s_paused_keys_the_longest_paused_first" + _STANDALONE,
            "tests/operator/test_dashboard.py::"
            "test_the_api_shows_paused_keys_roster_ages_and_failed_ops_among_a_key_s_recent",
        ),
    ),
    Mutant(
        "timeout-silent-on-paused-keys",
        "G7.19",
        "a SubmitTimeout never names the op's paused keys",
        (
            Edit(
                "keyserial/_client/asyncio_client.py",
                "            paused=[key for key in pending.all_keys if key in paused],\n",
                "            paused=[],\n",
            ),
        ),
        (
            "tests/operator/test_pause.py::"
            "test_a_submit_timing_out_on_a_paused_key_says_it_is_paused_and_how_to_resume_it"
            + _STANDALONE,
            "tests/security/test_acl.py::"
            "test_a_submit_timing_out_on_a_paused_key_as_the_client_user_says_it_is_paused"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "roster-age-never-flags",
        "G8.35",
        "status never marks a silent worker as maybe gone",
        (
            Edit(
                "keyserial/_operator/status.py",
                "        return self.renewed_ms_ago > ROSTER_SILENT * 1000\n",
                "        return False\n",
            ),
        ),
        (
            "tests/operator/test_status.py::"
            "test_status_says_when_each_worker_last_renewed_and_flags_one_that_missed_two"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "key-recent-skips-failed-ops",
        "G8.36",
        "the key inspector's recent ops ignore the posted failures",
        (
            Edit(
                "keyserial/_dashboard/views.py",
                '            for op in (*_newest_first(post, "recent"),'
                ' *_newest_first(post, "failed")):\n',
                '            for op in _newest_first(post, "recent"):\n',
            ),
        ),
        (
            "tests/operator/test_dashboard.py::"
            "test_the_api_shows_paused_keys_roster_ages_and_failed_ops_among_a_key_s_recent",
        ),
    ),
    Mutant(
        "refusal-stored-under-a-record-name",
        "G5.9",
        "a refusal of an op id holding '#' is stored under it, standing in for a record",
        (Edit(_INTAKE, '    return "#" not in op_id\n', "    return True\n"),),
        (
            _HOSTILE
            + "test_an_op_ahead_under_an_attempts_record_name_stores_nothing_there[standalone]",
            "tests/backend/test_scripts_idempotent.py::test_reserved_op_names_and_ids_are_refused[standalone]",
        ),
    ),
    Mutant(
        "grant-op-taken-from-a-stream",
        "G5.9",
        "a worker runs keyserial's grant op appended to a stream instead of refusing it as"
        " reserved",
        (Edit(_INTAKE, "        elif item.name == GRANT_OP:\n", "        elif False:\n"),),
        (_IDEMPOTENT + "test_reserved_op_names_and_ids_are_refused" + _STANDALONE,),
    ),
    Mutant(
        "hash-id-joins-a-run",
        "G5.9",
        "an op id holding '#' is looked up before it is refused: it joins a grant request's run,"
        " or is answered with the outcome of a participant's part",
        (
            _no_check(
                _INTAKE,
                "        if item.op_id is not None and reserved(item.op_id, fired):"
                "  # (before it joins a run)\n",
            ),
        ),
        (
            _IDEMPOTENT
            + "test_an_op_id_holding_a_hash_never_joins_a_run_nor_takes_its_outcome"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-forgets-holds",
        "G5.11",
        "a participant shard's next owner does not read its held hash: a hold the last owner"
        " recorded is lost, and ops run on keys a cross-shard op still holds",
        (Edit(_SHARD, "            await self._read_holds()\n", ""),),
        (
            _XS
            + "test_a_participant_s_next_owner_holds_its_keys_again_before_anything_runs"
            + "[cluster]",
        ),
    ),
    Mutant(
        "first-request-waits-a-poll",
        "G5.17",
        "a request signed by a worker whose listing is not read yet is dropped, not kept: a"
        " worker's first request to another waits for its coordinator's poll",
        (
            Edit(
                "keyserial/_worker/crossshard/mailbox.py",
                "        if self._unverified_count >= _UNVERIFIED_KEPT:\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_a_worker_s_first_grant_request_to_another_waits_for_no_poll" + _STANDALONE,
        ),
    ),
    Mutant(
        "request-sent-again-as-made",
        "G5.2",
        "a request sent again after a poll keeps the time it was first made: once that is half"
        " of result_ttl ago, the participant refuses every copy and the op never completes",
        (
            Edit(
                _COORDINATOR,
                "            request = request.again()"
                "  # (made now: a participant refuses an old one)\n",
                "",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_a_grant_request_lost_with_a_dead_owner_is_sent_again_to_the_next_one"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "part-names-no-home",
        "G5.18",
        "a participant names an attempt's part without its home shard: two ops of one op id"
        " homed on two shards share it, and the second's part is taken as answered",
        (
            Edit(
                "keyserial/_wire/layout.py",
                '    return f"{op_id}#{home}.{attempt}"\n',
                '    return f"{op_id}#{attempt}"\n',
            ),
        ),
        (
            _HOSTILE
            + "test_an_op_under_a_callers_op_id_homed_on_another_shard_never_takes_its_part"
            + "[cluster]",
        ),
    ),
    Mutant(
        "takeover-holds-any-record",
        "G5.11",
        "a new owner holds again what a held record names that is not a grant of its field's"
        " part (or names no home): its keys wait for a decision no coordinator makes",
        (
            Edit(
                _PARTICIPANT,
                "    if grant.home < 0 or part_id(grant.op_id, grant.home, grant.attempt)"
                " != field:\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/crossshard/test_cross_shard.py::"
            "test_a_held_record_that_is_not_a_grant_of_its_part_holds_nothing_at_takeover"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "earlier-lookup-by-last-keys",
        "G11.3",
        "an op id fetched twice in one batch, with other keys, is looked up in the layouts"
        " before a reshard by the last copy's keys only: the genuine copy runs again, its step"
        " is refused, and the owner starts again for ever",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "                missing.setdefault(envelope.op_id, set()).add(envelope.keys)\n",
                "                missing[envelope.op_id] = {envelope.keys}\n",
            ),
        ),
        (
            "tests/reshard/test_earlier_layouts.py::"
            "test_an_op_id_appended_again_with_other_keys_is_answered_from_an_earlier_layout"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "reserved-id-struck-as-suspect",
        "G5.9",
        "a takeover strikes an entry under an op id holding '#' as the suspect: struck dead,"
        " its poison record is stored under a name keyserial keeps for a participant's part",
        (
            Edit(
                _LUA + "acquire.lua",
                "                  and not string.find(envelope.id, '#', 1, true)\n",
                "",
            ),
        ),
        (
            _IDEMPOTENT
            + "test_an_entry_refused_as_reserved_left_by_a_crash_is_never_a_suspect"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "push-dropped-while-running",
        "G3.13",
        "a step takes every pushed entry out of the inbox for nowhere, also one whose op still"
        " runs: a takeover never runs it again",
        (
            Edit(
                _SHARD,
                '["1" if entry.remaining or f"+{n}" in named else "0"'
                " for n, entry in enumerate(pushed, 1)]",
                '["0" for n, entry in enumerate(pushed, 1)]',
            ),
        ),
        (_INBOX + "test_progress_never_passes_a_pushed_entry_whose_op_still_runs" + _STANDALONE,),
    ),
    Mutant(
        "poll-skips-busy-runners",
        "G3.13",
        "the poll leaves a busy runner be: an entry taken in from a push waits in the inbox"
        " while its op runs on and nothing else steps, a backlog status cannot age",
        (
            Edit(
                "keyserial/_worker/worker.py",
                "                else:\n                    held.runner.entries_waiting()\n",
                "",
            ),
        ),
        (
            _INBOX
            + "test_a_pushed_entry_whose_op_runs_on_moves_into_the_stream_though_nothing_steps"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "oom-taken-for-no-id-left",
        "G6.21",
        "a move into the stream refused out of memory is taken for a stream with no id left: the"
        " owner gives its shard up instead of waiting the server out",
        (
            Edit(
                _LUA + "lib.lua",
                "elseif string.find(id.err, 'exhausted the last possible ID', 1, true) then",
                "elseif true then",
            ),
        ),
        (_INBOX + "test_a_move_refused_out_of_memory_writes_nothing_and_is_sent_again",),
        fast=True,
    ),
    Mutant(
        "pushed-dead-letter-dropped",
        "G3.13",
        "a step takes a pushed entry with a dead letter out of the inbox for nowhere: the letter"
        " names no entry",
        (Edit(_SHARD, ' or f"+{n}" in named else "0"', ' else "0"'),),
        (
            _INBOX
            + "test_a_dead_letter_of_a_pushed_entry_names_the_entry_it_was_moved_in_as"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "resend-taken-unchecked",
        "G3.8",
        "step.lua takes pushed items not in the inbox as moved in by a first sending of the step,"
        " whatever the taken count: a forged push whose ops all ran commits",
        (
            Edit(
                _STEP,
                "  if tonumber(redis.call('GET', KEYS[15]) or '0')"
                " < pushed_place + #pushed - 1 then\n    return nil\n  end\n",
                "",
            ),
        ),
        (
            _INBOX
            + "test_a_pushed_entry_whose_ops_have_committed_leaves_the_inbox_for_nowhere"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "seal-leaves-the-inbox",
        "G3.13",
        "seal.lua names the stream's last entry with the inbox still unmoved: ops pushed before"
        " the seal are forwarded past it, behind newer ops on their keys",
        (Edit(_LUA + "seal.lua", "move_inbox(KEYS[3], KEYS[4], KEYS[1])\n", ""),),
        (
            _INBOX
            + "test_a_seal_moves_the_inbox_into_the_stream_before_it_names_the_last_entry"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "sweep-takes-any-moved-entry",
        "G3.13",
        "present.lua counts an overdue op's entry there if any entry moved in since it was pushed"
        " is: one a failover lost is never pushed again",
        (
            Edit(
                _LUA + "present.lua",
                "if fields[i] == 'p' and fields[i + 1] == ARGV[at] then",
                "if fields[i] == 'p' then",
            ),
        ),
        (
            _INBOX
            + "test_the_sweep_finds_an_entry_in_the_inbox_or_moved_in_by_its_place"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "sweep-takes-places-past-the-inbox",
        "G3.13",
        "present.lua counts an item there whatever its place past the moved ones: one a failover"
        " lost is never pushed again",
        (
            Edit(
                _LUA + "present.lua",
                "if place > taken and place <= taken + length then",
                "if place > taken then",
            ),
        ),
        (
            _INBOX
            + "test_the_sweep_finds_an_entry_in_the_inbox_or_moved_in_by_its_place"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "resent-step-takes-any-entries",
        "G3.13",
        "step.lua takes the entries after the cursor for a pushed item's, whatever they hold: a"
        " forged push commits what ran it",
        (Edit(_STEP, "      if entry[2][j] ~= fields[j] then\n", "      if false then\n"),),
        (
            _INBOX
            + "test_a_step_sent_again_after_its_reply_was_lost_moves_its_pushed_items_once"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "move-past-the-largest-id",
        "G3.13",
        "lib.lua's move_items trims the inbox whether or not the stream took its items: ops pushed"
        " while the stream has no id left are lost",
        (
            Edit(
                _LUA + "lib.lua",
                "  if #ids > 0 then\n    redis.call('LTRIM', inbox, #ids, -1)\n",
                "  if #items > 0 then\n    redis.call('LTRIM', inbox, #items, -1)\n",
            ),
        ),
        (_INBOX + "test_items_wait_in_the_inbox_while_the_stream_has_no_id_left" + _STANDALONE,),
        fast=True,
    ),
    Mutant(
        "takeover-leaves-the-inbox",
        "G3.7",
        "acquire.lua and release.lua count what the stream holds as fetched by an owner that"
        " took pushes, leaving the inbox unmoved: an op it ran from a push is not suspected",
        (Edit(_LUA + "lib.lua", "  move_inbox(inbox_key, taken_key, stream_key)\n", ""),),
        (
            _PUSH
            + "test_a_takeover_counts_every_entry_as_fetched_if_the_dead_owner_took_pushes"
            + _STANDALONE,
            _PUSH + "test_a_pushed_op_that_kills_its_worker_is_struck_at_every_death" + _STANDALONE,
        ),
    ),
    Mutant(
        "pushed-dead-letter-unnamed",
        "G3.13",
        "step.lua records a pushed entry's dead letter under the runner's '+<n>', not the id the"
        " entry was moved in as",
        (Edit(_STEP, "    if string.sub(entry, 1, 1) == '+' then", "    if false then"),),
        (
            _INBOX
            + "test_a_dead_letter_of_a_pushed_entry_names_the_entry_it_was_moved_in_as"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "push-overtakes-the-stream",
        "G3.7",
        "step.lua moves pushed items in behind an entry appended to the stream itself that no"
        " fetch brought: the push ran first, and the entry is skipped",
        (
            Edit(
                _STEP,
                "  if same and #xrange_after(KEYS[4], ARGV[4], '+', 1) > 0 then",
                "  if false then",
            ),
        ),
        (
            _INBOX
            + "test_an_entry_appended_to_the_stream_itself_is_never_overtaken_by_a_push"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "push-taken-behind-an-unread-fetch",
        "G3.7",
        "a worker takes pushes while its last fetch may have left entries in the stream",
        (
            Edit(
                "keyserial/_worker/wakeups.py",
                "if not self.recorded or not self.caught_up or not self._waiting:",
                "if not self.recorded or not self._waiting:",
            ),
        ),
        (
            "tests/worker/test_wakeups.py::"
            "test_no_push_is_taken_while_a_fetch_may_have_left_entries_in_the_stream",
        ),
        fast=True,
    ),
    Mutant(
        "heir-leaves-retired-inbox",
        "G11.4",
        "the heir of a retired shard forwards what its stream holds, not what a stale client"
        " pushed to its inbox: those ops are never run",
        (
            Edit(
                "keyserial/_worker/strays.py",
                "            await strays.forward_items(backend, int(taken or 0), items)\n",
                "            pass\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_op_pushed_with_a_plain_rpush_to_a_retired_shard_is_forwarded_and_runs_once"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "heir-exposes-strays",
        "G11.4",
        "the heir of a retired shard appends its inbox items to its stream before forwarding"
        " them: a client user reads a stale client's op id there and takes it ahead",
        (
            Edit(
                "keyserial/_worker/strays.py",
                '            fields = item_fields(item) or {b"raw": item}\n',
                '            fields = item_fields(item) or {b"raw": item}\n'
                '            await backend.call("XADD", self.keys.stream, "*",'
                " *fields_of(fields))\n",
            ),
            Edit(
                "keyserial/_worker/strays.py",
                "def _name(keys: ShardKeys) -> str:\n",
                "def fields_of(fields: dict[bytes, bytes]) -> list[bytes]:\n"
                "    return [part for pair in fields.items() for part in pair]\n\n\n"
                "def _name(keys: ShardKeys) -> str:\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_op_pushed_with_a_plain_rpush_to_a_retired_shard_is_forwarded_and_runs_once"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-step-moves-strays-in",
        "G11.4",
        "a sealed shard's step moves what a stale client pushed past the seal into the old"
        " stream before it is forwarded: a client user reads its op id there and takes it ahead",
        (Edit(_STEP, "  if #items > 0 and not seal then\n", "  if #items > 0 then\n"),),
        (
            _RESHARD
            + "test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "takeover-moves-sealed-inbox-in",
        "G11.4",
        "a takeover (or release) after an owner that took pushes moves a sealed shard's inbox"
        " into its stream: a stale client's op id is readable there before it is forwarded",
        (
            Edit(
                _LUA + "lib.lua",
                "  if redis.call('EXISTS', sealed_key) == 0 then\n",
                "  if true then\n",
            ),
        ),
        (
            _RESHARD
            + "test_a_worker_that_takes_a_sealed_shard_over_forwards_what_follows_the_seal"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "seal-unread-where-strays-wait",
        "G11.4",
        "a step that leaves strays in a sealed shard's inbox does not say it is sealed: an owner"
        " that missed the seal's wake-up forwards nothing until its poll",
        (
            Edit(
                _STEP,
                "  if #skipped > 0 or #moved > 0 or seal or next_timer then\n",
                "  if #skipped > 0 or #moved > 0 or next_timer then\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-owner-leaves-inbox",
        "G11.4",
        "a sealed shard's owner never forwards what a stale client pushed to its inbox: those"
        " ops wait for the flip",
        (
            Edit(
                _SHARD,
                "                if fetch and self.sealed:\n"
                "                    self._drain.forward_inbox()\n",
                "",
            ),
        ),
        (
            _RESHARD
            + "test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-strays-dead-lettered-behind",
        "G11.4",
        "a sealed shard dead-letters what a stale client pushed past its seal in its own dead"
        " letters, which the mover may have copied to the new layout already: nobody lists them",
        (
            Edit(
                "keyserial/_worker/draining.py",
                "        strays = Strays.of(self._keys, target, target)\n",
                "        strays = Strays(self._keys, target, self._keys.dead)\n",
            ),
        ),
        (
            _RESHARD
            + "test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "forwarded-takes-whatever-taken",
        "G11.4",
        "forwarded.lua takes items out of a retired shard's inbox whatever its taken count: a"
        " second forwarder of the same items takes out ones neither read, which are lost",
        (
            Edit(
                _LUA + "forwarded.lua",
                "if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[1] then\n",
                "if false then\n",
            ),
        ),
        (
            _RESHARD
            + "test_forwarded_strays_leave_a_retired_inbox_once_and_only_those_read"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "caught-up-at-any-full-fetch",
        "G3.7",
        "a worker counts a fetch that got a full batch as having reached the end of the stream,"
        " whatever its last entry: pushes overtake what it left there",
        (
            Edit(
                "keyserial/_worker/wakeups.py",
                "(taken is not None and last == str(taken))",
                "(taken is not None)",
            ),
        ),
        (
            "tests/worker/test_wakeups.py::"
            "test_no_push_is_taken_while_a_fetch_may_have_left_entries_in_the_stream",
        ),
        fast=True,
    ),
    Mutant(
        "timers-fire-early",
        "G12.1",
        "a step fires every timer, due or not",
        (
            Edit(
                _LIB,
                "redis.call('ZRANGE', timers, '-inf', now, 'BYSCORE'",
                "redis.call('ZRANGE', timers, '-inf', '+inf', 'BYSCORE'",
            ),
        ),
        (
            _TIMER_SCRIPTS
            + "test_a_step_fires_what_is_due_in_order_and_says_when_the_next_is_due"
            + _STANDALONE,
            _DELAYED
            + "test_a_delayed_op_runs_once_due_behind_the_ops_appended_before_then"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "timers-fire-twice",
        "G12.1",
        "a step fires a due timer without removing it: it fires again at every fetch",
        (Edit(_LIB, "    redis.call('ZREM', timers, unpack(fired))\n", ""),),
        (
            _TIMER_SCRIPTS
            + "test_a_step_fires_what_is_due_in_order_and_says_when_the_next_is_due"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "timers-fire-in-id-order-only",
        "G12.1",
        "timers due in one millisecond fire in the order of their ids as text (place 10 before 9)",
        (
            Edit(
                _LIB,
                "  return string.format('%016d', place)",
                "  return string.format('%d', place)",
            ),
        ),
        (
            _TIMER_SCRIPTS
            + "test_a_step_fires_what_is_due_in_order_and_says_when_the_next_is_due"
            + _STANDALONE,
            _DELAYED
            + "test_delayed_ops_due_in_one_millisecond_run_in_the_order_they_were_appended"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "sealed-shard-fires-timers",
        "G12.2",
        "a sealed shard's step fires its due timers (a reshard moves them too)",
        (
            Edit(
                _STEP,
                "  if not seal then\n    local _\n    _, next_timer",
                "  if true then\n    local _\n    _, next_timer",
            ),
        ),
        (_TIMER_SCRIPTS + "test_a_sealed_shard_fires_no_timer" + _STANDALONE,),
        fast=True,
    ),
    Mutant(
        "mover-leaves-timers",
        "G12.2",
        "a reshard leaves the old shards' timers where they are: they never fire",
        (
            Edit(
                "keyserial/_reshard/mover.py",
                "    await _move_timers(backend, move, progress)\n",
                "",
            ),
        ),
        (
            "tests/timers/test_timer_reshard.py::"
            "test_pending_timers_move_with_their_keys_and_fire_once_in_the_new_layout"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "alarm-never-rings",
        "G12.1",
        "an owner keeps no alarm for its next timer: timers fire at its poll",
        (
            Edit(
                _SHARD,
                "            self._alarm.follow(fetched.next_timer_ms, fetched.timers_waiting)",
                "            pass",
            ),
        ),
        (
            _DELAYED
            + "test_an_idle_owner_wakes_for_its_next_timer_rather_than_its_poll"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "pushed-delayed-item-taken",
        "G12.3",
        "a worker takes a pushed item whose first line ends in a due time as a fresh one",
        (
            Edit(
                "keyserial/_wire/codec.py",
                '    if not newline or not version or (space and flags != b"fresh"):',
                '    if not newline or not version or (space and not flags.startswith(b"fresh")):',
            ),
        ),
        (_HAND + "test_a_forged_push_of_a_delayed_item_never_runs_it_early" + _STANDALONE,),
    ),
    Mutant(
        "due-time-unchecked",
        "G12.3",
        "a step takes a due time of any length (16 digits lose their last ones to Lua's numbers)",
        (Edit(_LIB, "  if not head or #due > 15 then", "  if not head then"),),
        (
            _HAND + "test_a_delayed_item_whose_due_time_cannot_be_read_is_dead_lettered"
            "[standalone-1 at 1000000000000000]",
        ),
    ),
    Mutant(
        "present-misses-timers",
        "G12.3",
        "the client's sweep looks for an overdue op in its shard's inbox and stream, not its"
        " timers: it appends a second copy",
        (
            Edit(
                _LUA + "present.lua",
                "  elseif place <= taken and redis.call('HGET', timed,",
                "  elseif false and redis.call('HGET', timed,",
            ),
        ),
        (
            _DELAYED
            + "test_an_awaited_delayed_op_due_while_no_worker_runs_is_not_appended_again"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "submit-due-unchecked",
        "G12.4",
        "the submit script pushes an item whatever its due time argument holds",
        (
            Edit(
                _LUA + "submit.lua",
                "if not shard or #ARGV < 4 or (due_arg ~= ''"
                " and (not digits or #digits > 15)) then",
                "if not shard or #ARGV < 4 then",
            ),
        ),
        (
            _TIMER_SCRIPTS
            + "test_the_submit_script_refuses_a_due_time_it_cannot_read_and_pushes_nothing"
            + "[standalone-soon]",
        ),
    ),
    Mutant(
        "failed-op-sets-its-timers",
        "G12.5",
        "an op that raises still sets the timers it set before raising",
        (
            Edit(
                _EXECUTION,
                "            return self._error_outcome(envelope, value.error), None, None\n",
                "            return self._error_outcome(envelope, value.error), None, (\n"
                "                timer_changes(context) if isinstance(context, Context) else None\n"
                "            )\n",
            ),
        ),
        (_OP_TIMERS + "test_an_op_that_raises_sets_no_timer" + _STANDALONE,),
    ),
    Mutant(
        "cancel-forgotten-inline",
        "G12.5",
        "a timer that fired before its cancel ran, and waits behind it, runs anyway",
        (
            Edit(
                _EXECUTION,
                "        if self.cancelled and envelope.op_id in self.cancelled:",
                "        if False:",
            ),
        ),
        (
            _OP_TIMERS
            + "test_a_timer_that_fired_and_waits_behind_its_cancel_never_runs[standalone-inline]",
        ),
    ),
    Mutant(
        "cancel-forgotten-in-a-trip",
        "G12.5",
        "a timer's sync op runs in the same trip to a thread as the op that cancelled it",
        (
            Edit(
                _EXECUTION,
                "            if (op_id := run.envelope.op_id) in self.executor.cancelled:",
                "            if (op_id := run.envelope.op_id) in ():",
            ),
        ),
        (
            _OP_TIMERS
            + "test_a_timer_that_fired_and_waits_behind_its_cancel_never_runs"
            + "[standalone-in a thread]",
        ),
    ),
    Mutant(
        "cancel-stores-no-answer",
        "G12.5",
        "a cancel removes the timer but stores nothing under its id: a fetch of its op looks"
        " nothing up, and ks.result() finds nothing",
        (Edit(_STEP, "      redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])\n", ""),),
        (
            _TIMER_SCRIPTS
            + "test_a_commit_sets_its_ops_timers_and_cancels_others_storing_their_answer"
            + _STANDALONE,
            _OP_TIMERS + "test_paying_cancels_the_hold_s_timer_with_its_write" + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "cancel-overwrites-an-outcome",
        "G12.5",
        "a cancel stores its answer over the outcome of a timer's op that ran before it",
        (
            Edit(
                _STEP,
                "    if not has_outcome(KEYS[5], KEYS[6], ARGV[i]) then\n",
                "    if true then\n",
            ),
        ),
        (
            _TIMER_SCRIPTS
            + "test_a_commit_sets_its_ops_timers_and_cancels_others_storing_their_answer"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "timer-op-id-from-any-entry",
        "G12.5",
        "an entry no timer fired runs an op under a timer's id: a client runs it ahead, or"
        " answers it with an outcome of its own",
        (
            Edit(
                _INTAKE,
                '    return "#" in op_id and not (fired and is_timer_id(op_id))',
                '    return "#" in op_id and not is_timer_id(op_id)',
            ),
        ),
        (
            "tests/timers/test_timer_intake.py::"
            "test_a_timer_s_op_id_in_an_entry_no_timer_fired_is_refused[a#t1]",
            _OP_TIMERS
            + "test_an_entry_a_client_pushes_under_a_timer_s_op_id_is_refused"
            + _STANDALONE,
        ),
        fast=True,
    ),
    Mutant(
        "fired-timer-unmarked",
        "G12.5",
        "a timer an op set fires unmarked: its op id is refused as reserved, and it never runs",
        (
            Edit(
                _LIB,
                "        fields[#fields + 1] = 'timer'\n        fields[#fields + 1] = '1'\n",
                "",
            ),
        ),
        (
            _TIMER_SCRIPTS + "test_a_timer_an_op_set_fires_marked_as_one" + _STANDALONE,
            _OP_TIMERS + "test_a_seat_hold_lapses_by_the_timer_its_op_set" + _STANDALONE,
        ),
    ),
    Mutant(
        "alarm-ignores-timers-just-set",
        "G12.5",
        "an owner sets no alarm for a timer its op just committed: it fires at the next poll",
        (
            Edit(
                _SHARD,
                "                self._alarm.expect(min(delay for _, delay, _ in"
                " finished.timers.set))",
                "                pass",
            ),
        ),
        (_OP_TIMERS + "test_an_idle_owner_wakes_for_a_timer_its_op_just_set" + _STANDALONE,),
    ),
    Mutant(
        "due-items-skip-the-timers",
        "G12.1",
        "a delayed item due by the time its owner moves it out of the inbox goes straight to the"
        " stream, in push order, ahead of timers due before it",
        (
            Edit(
                _LIB,
                "    if item_due(item) then\n",
                "    if item_due(item) and item_due(item) > now_ms() then\n",
            ),
            Edit(
                _LIB,
                "      id = append_moved(stream, inbox_entry(item, place))\n",
                "      local _, waiting = item_due(item)\n"
                "      id = append_moved(stream, inbox_entry(waiting or item, place))\n",
            ),
        ),
        (
            _TIMER_SCRIPTS
            + "test_delayed_items_that_came_due_in_the_inbox_fire_in_due_order_with_the_timers"
            + _STANDALONE,
        ),
    ),
    Mutant(
        "enqueue-unconfirmed",
        "G4.4",
        "an enqueue returns once its append is on the master, whatever durable_replicas asks:"
        " a failover can lose an op its caller was told was appended",
        (
            Edit(
                "keyserial/_client/appender.py",
                "        if not any([pending.appended_only for pending in batch]):\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/faults/test_durability.py::"
            "test_an_enqueue_returns_only_once_a_replica_has_its_append",
        ),
    ),
)


def names() -> list[str]:
    return [mutant.name for mutant in MUTANTS]


def mutated(mutant: Mutant, root: Path) -> dict[str, str]:
    """Every file ``mutant`` changes under ``root``, as the mutant has it (MutantDrift if an old
    text does not occur exactly once)."""
    texts: dict[str, str] = {}
    for edit in mutant.edits:
        text = texts.get(edit.path) or (root / edit.path).read_text()
        count = text.count(edit.old)
        if count != 1:
            raise MutantDrift(mutant.name, edit.path, count)
        texts[edit.path] = text.replace(edit.old, edit.new)
    return texts


@dataclass(frozen=True)
class Verdict:
    mutant: Mutant
    killed: bool
    killer: str  # the first failing test, or what ended the run
    seconds: float


def run(mutant: Mutant, *, root: Path = ROOT) -> Verdict:
    """Apply ``mutant`` to a fresh copy of ``root`` and run its tests there."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as temp:
        copy = Path(temp) / "repo"
        shutil.copytree(root, copy, ignore=_SKIP)
        for path, text in mutated(mutant, copy).items():
            (copy / path).write_text(text)
        env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
        # One process (-n 0): under xdist, -x ends the run as interrupted (exit code 2).
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "0",
            "-x",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            *mutant.tests,
        ]
        try:
            done = subprocess.run(
                command,
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
                timeout=MUTANT_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Verdict(
                mutant, True, f"timeout after {MUTANT_TIMEOUT:.0f} s", time.monotonic() - began
            )
    seconds = time.monotonic() - began
    if done.returncode == 0:
        return Verdict(mutant, False, "", seconds)
    failed = re.findall(r"^(?:FAILED|ERROR) (tests/.+?)(?: - .*)?$", done.stdout, re.MULTILINE)
    if done.returncode != 1 or not failed:
        raise RuntimeError(
            f"mutant {mutant.name}: pytest exited {done.returncode} without a"
            f" failing test:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return Verdict(mutant, True, failed[0], seconds)


def select(*, fast: bool, only: Sequence[str]) -> list[Mutant]:
    unknown = set(only) - set(names())
    if unknown:
        raise SystemExit(f"unknown mutants: {', '.join(sorted(unknown))} (see --list)")
    chosen = [m for m in MUTANTS if (not only or m.name in only) and (m.fast or not fast)]
    for mutant in chosen:
        mutated(mutant, ROOT)  # every edit still applies, before anything runs
    missing = unknown_tests([test for mutant in chosen for test in mutant.tests])
    if missing:
        raise SystemExit(f"mutants name tests that do not exist: {', '.join(missing)}")
    return chosen


def unknown_tests(node_ids: Sequence[str]) -> list[str]:
    """The node ids pytest does not collect (in this repository, not a copy)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "0",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *sorted({node.split("::")[0] for node in node_ids}),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    collected = set(done.stdout.split("\n"))
    return sorted({node for node in node_ids if node not in collected})


def markdown(mutants: Sequence[Mutant]) -> str:
    """What each mutant breaks, as a table (docs/mutants.md holds it as it is)."""
    rows = [f"| `{m.name}` | {m.claim} | {'yes' if m.fast else ''} | {m.what} |" for m in mutants]
    header = "| mutant | claim | in CI | what it breaks |\n|---|---|---|---|\n"
    return header + "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__)
    parser.add_argument("--fast", action="store_true", help="only the subset CI runs")
    parser.add_argument("--only", action="append", default=[], metavar="NAME")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--markdown", action="store_true", help="what each breaks, as docs/mutants.md shows it"
    )
    options = parser.parse_args(argv)
    chosen = select(fast=options.fast, only=options.only)
    if options.markdown:
        print(markdown(chosen), end="")
        return 0
    if options.list:
        for mutant in chosen:
            print(
                f"{mutant.name:40} {mutant.claim:6} {'fast' if mutant.fast else '':5} {mutant.what}"
            )
        return 0
    print("| mutant | claim | killed? | killed by | seconds |\n|---|---|---|---|---:|")
    survivors = 0
    for mutant in chosen:
        verdict = run(mutant)
        survivors += not verdict.killed
        print(
            f"| `{mutant.name}` | {mutant.claim} | {'yes' if verdict.killed else '**no**'}"
            f" | {f'`{verdict.killer}`' if verdict.killer else '—'} | {verdict.seconds:.0f} |",
            flush=True,
        )
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
