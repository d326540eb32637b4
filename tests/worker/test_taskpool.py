"""The worker's task pool: a task that has run its job takes the next one, and the pool's tasks
end with their task group, parked ones included."""

from __future__ import annotations

import anyio
import pytest

from keyserial._worker.taskpool import TaskPool


async def test_a_task_that_has_run_its_job_runs_the_next_one() -> None:
    ran: list[tuple[int, object]] = []

    async def job(number: int) -> None:
        ran.append((number, anyio.get_current_task().id))

    async with anyio.create_task_group() as group:
        pool = TaskPool(group)
        for number in range(5):
            pool.start_soon(job, number)
            await anyio.wait_all_tasks_blocked()
        group.cancel_scope.cancel()
    assert [number for number, _ in ran] == [0, 1, 2, 3, 4]
    assert len({task for _, task in ran}) == 1, ran


async def test_jobs_that_overlap_run_side_by_side_and_at_most_max_parked_tasks_stay() -> None:
    release = anyio.Event()
    started: list[int] = []

    async def job(number: int) -> None:
        started.append(number)
        await release.wait()

    async with anyio.create_task_group() as group:
        pool = TaskPool(group, max_parked=2)
        for number in range(4):
            pool.start_soon(job, number)
        await anyio.wait_all_tasks_blocked()
        assert sorted(started) == [0, 1, 2, 3]  # four tasks: none waits for another
        release.set()
        await anyio.wait_all_tasks_blocked()
        # Two of the four ended once their jobs were done; two are parked.
        assert len(pool._parked) == 2
        group.cancel_scope.cancel()
    assert all(parked.cancelled() for parked in pool._parked)


async def test_a_job_s_error_ends_the_task_group() -> None:
    async def failing() -> None:
        raise RuntimeError("boom")

    with pytest.raises(ExceptionGroup) as caught:
        async with anyio.create_task_group() as group:
            pool = TaskPool(group)
            pool.start_soon(anyio.sleep, 0)
            await anyio.wait_all_tasks_blocked()
            pool.start_soon(failing)  # (in the parked task)
            await anyio.sleep(10)
    assert caught.group_contains(RuntimeError, match="boom")
