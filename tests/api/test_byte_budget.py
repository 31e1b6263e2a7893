"""The bytes-in-flight budget: first come first served, bounded waits, nothing leaked."""

from __future__ import annotations

import asyncio

import pytest

from api.edge.budget import ByteBudget


async def test_a_body_that_does_not_fit_waits_and_is_let_in_when_room_comes() -> None:
    budget = ByteBudget(100)
    assert await budget.take(70, wait_s=1)
    waiting = asyncio.create_task(budget.take(50, wait_s=5))
    await asyncio.sleep(0.01)
    assert not waiting.done() and budget.waiting == 1
    budget.give(70)
    assert await waiting and budget.used == 50 and budget.waiting == 0


async def test_the_line_is_first_come_first_served() -> None:
    """A small body behind a large waiting one waits too, though it would fit now."""
    budget = ByteBudget(100)
    assert await budget.take(60, wait_s=1)
    order: list[str] = []

    async def take(name: str, size: int) -> None:
        assert await budget.take(size, wait_s=5)
        order.append(name)

    large = asyncio.create_task(take("large", 90))
    await asyncio.sleep(0.01)
    small = asyncio.create_task(take("small", 20))
    await asyncio.sleep(0.01)
    assert order == [] and budget.waiting == 2
    assert not budget.grow(20)  # nobody passes the line either
    budget.give(60)
    await large
    assert order == ["large"] and budget.waiting == 1
    budget.give(90)
    await small
    assert order == ["large", "small"] and budget.used == 20


async def test_a_wait_that_outlasts_its_bound_leaves_the_line_and_takes_nothing() -> None:
    budget = ByteBudget(100)
    assert await budget.take(100, wait_s=1)
    assert not await budget.take(10, wait_s=0.05)
    assert budget.waiting == 0 and budget.used == 100
    budget.give(100)
    assert budget.used == 0


async def test_one_leaving_the_head_of_the_line_lets_in_those_behind_who_fit() -> None:
    budget = ByteBudget(100)
    assert await budget.take(50, wait_s=1)
    head = asyncio.create_task(budget.take(80, wait_s=0.05))
    await asyncio.sleep(0.01)
    behind = asyncio.create_task(budget.take(40, wait_s=5))
    assert not await head  # gave up: the 40 behind it fits beside the 50 held
    assert await behind and budget.used == 90


async def test_a_cancelled_wait_leaks_no_room() -> None:
    budget = ByteBudget(100)
    assert await budget.take(100, wait_s=1)
    waiting = asyncio.create_task(budget.take(30, wait_s=5))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.give(100)
    assert budget.used == 0 and budget.waiting == 0


async def test_one_body_always_fits_an_empty_budget() -> None:
    budget = ByteBudget(100)
    assert await budget.take(150, wait_s=0.01)
    assert not budget.fits(1)
    budget.give(150)
    assert budget.used == 0
