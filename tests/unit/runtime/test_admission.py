"""Admission: a FIFO queue bounded in length and wait, fair to requests that need several generations."""

from __future__ import annotations

import asyncio

import pytest

from tally_runtime.admission import Admission, QueueFull


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_beyond_the_limit_wait_and_run_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=2, max_queued=8, max_wait=30)
        order: list[str] = []

        async def request(name: str, count: int) -> None:
            await admission.acquire(count)
            order.append(name)

        await admission.acquire(2)  # the server is full
        tasks = [asyncio.create_task(request(name, 1)) for name in "abc"]
        await settle()
        assert order == [] and admission.queued == 3
        admission.release(1)
        await settle()
        assert order == ["a"]
        admission.release(1)
        await settle()
        assert order == ["a", "b"] and admission.queued == 1
        admission.release(2)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_large_request_at_the_head_is_not_overtaken() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=4, max_queued=8, max_wait=30)
        order: list[str] = []

        async def request(name: str, count: int) -> None:
            await admission.acquire(count)
            order.append(name)

        await admission.acquire(3)
        big = asyncio.create_task(request("n=4", 4))
        await settle()
        small = asyncio.create_task(request("n=1", 1))  # would fit now, but must not jump the queue
        await settle()
        assert order == []
        admission.release(3)
        await settle()
        assert order == ["n=4"]  # small waits for capacity after the big one
        admission.release(4)
        await asyncio.gather(big, small)
        return order

    assert asyncio.run(scenario()) == ["n=4", "n=1"]


def test_queue_length_and_wait_are_bounded() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, max_queued=1, max_wait=0.05)
        await admission.acquire(1)
        waiter = asyncio.create_task(admission.acquire(1))
        await settle()
        with pytest.raises(QueueFull, match="already waiting"):
            await admission.acquire(1)
        with pytest.raises(QueueFull, match="no capacity within"):
            await waiter
        assert admission.queued == 0 and admission.used == 1

    asyncio.run(scenario())


def test_no_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, max_queued=0, max_wait=30)
        await admission.acquire(1)
        with pytest.raises(QueueFull):
            await admission.acquire(1)

    asyncio.run(scenario())


def test_a_waiter_that_leaves_frees_its_place_and_lets_the_next_in() -> None:
    async def scenario() -> None:
        admission = Admission(limit=2, max_queued=8, max_wait=30)
        await admission.acquire(1)
        head = asyncio.create_task(admission.acquire(2))  # needs both slots
        await settle()
        behind = asyncio.create_task(admission.acquire(1))
        await settle()
        assert not behind.done()
        head.cancel()  # the client went away while queued
        await settle()
        assert behind.done() and admission.used == 2 and admission.queued == 0

    asyncio.run(scenario())


def test_a_grant_that_races_a_timeout_is_handed_back() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, max_queued=8, max_wait=30)
        await admission.acquire(1)
        waiter = asyncio.create_task(admission.acquire(1))
        await settle()
        admission.release(1)  # grants the waiter...
        waiter.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.used == 0 and admission.idle

    asyncio.run(scenario())


def test_a_waiter_cancelled_in_the_same_turn_as_a_release_is_never_granted() -> None:
    """The client leaves (its task is cancelled) and a finishing request releases before that task runs
    again: the slot goes to the next waiter, the cancelled one gets its CancelledError, nothing leaks."""
    async def scenario() -> None:
        admission = Admission(limit=1, max_queued=8, max_wait=30)
        await admission.acquire(1)
        leaving = asyncio.create_task(admission.acquire(1))
        staying = asyncio.create_task(admission.acquire(1))
        await settle()
        leaving.cancel()  # same loop turn: the cancel lands first...
        admission.release(1)  # ...then the release walks the queue, its head already cancelled
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await staying
        assert admission.used == 1 and admission.queued == 0
        admission.release(1)
        assert admission.idle

    asyncio.run(scenario())


def test_a_timeout_and_a_release_in_the_same_turn_resolve_once_each() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, max_queued=8, max_wait=0.01)
        await admission.acquire(1)
        waiter = asyncio.create_task(admission.acquire(1))
        await settle()
        await asyncio.sleep(0.02)  # its timeout has fired (its future is cancelled); its task has not resumed
        admission.release(1)
        with pytest.raises(QueueFull):
            await waiter
        assert admission.used == 0 and admission.idle
        await admission.acquire(1)  # the server still admits
        assert admission.used == 1

    asyncio.run(scenario())


def test_a_storm_of_waiters_leaving_while_slots_are_released_leaks_nothing() -> None:
    """Hundreds of waiters, a third cancelled, a third timing out, releases in between, in every order."""
    async def scenario() -> None:
        admission = Admission(limit=2, max_queued=1000, max_wait=0.005)
        admitted = 0

        async def request(i: int) -> None:
            nonlocal admitted
            try:
                await admission.acquire(1 + i % 2)
            except QueueFull:
                return
            admitted += 1
            await asyncio.sleep(0.001 * (i % 3))
            admission.release(1 + i % 2)

        tasks = [asyncio.create_task(request(i)) for i in range(600)]
        for i, task in enumerate(tasks):
            if i % 3 == 0:
                task.cancel()
            if i % 50 == 0:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert admitted > 0 and admission.used == 0 and admission.queued == 0 and admission.idle
        await asyncio.wait_for(admission.acquire(2), 1)  # and it still admits

    asyncio.run(scenario())
