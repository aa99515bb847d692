"""The serve request queue with several slots: N requests hold a slot at once, at most max_queue wait, one more gets 429;
a whole-model holder waits for every slot (no model: the queue alone)."""

from __future__ import annotations

import anyio
import pytest

from ggmoe.serve.errors import APIError
from ggmoe.serve.request_queue import RequestQueue


async def _fill(queue: RequestQueue, n: int) -> list[int]:
    return [await queue.enter() for _ in range(n)]


@pytest.mark.parametrize("n_lanes,max_queue", [(1, 0), (1, 2), (2, 0), (4, 1), (4, 3)])
def test_n_run_queue_waits_then_429(n_lanes, max_queue):
    async def main() -> None:
        queue = RequestQueue(max_queue, n_lanes)
        tickets = await _fill(queue, n_lanes)  # every slot held: none of these waited
        assert queue.running == n_lanes and queue.waiting == 0
        entered: list[int] = []
        async with anyio.create_task_group() as tg:
            for _ in range(max_queue):
                tg.start_soon(lambda: _enter_into(queue, entered))
            await _until(lambda: queue.waiting == max_queue)
            with pytest.raises(APIError) as e:
                await queue.enter()
            assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
            for t in tickets:
                queue.leave(t)
        assert len(entered) == max_queue and queue.running == 0 and queue.waiting == 0

    anyio.run(main)


async def _enter_into(queue: RequestQueue, out: list[int]) -> None:
    t = await queue.enter()
    out.append(t)
    await anyio.sleep(0)
    queue.leave(t)


async def _until(cond) -> None:
    with anyio.fail_after(5):
        while not cond():
            await anyio.sleep(0)


def test_whole_model_waits_for_every_slot_and_blocks_new_ones():
    async def main() -> None:
        queue = RequestQueue(8, 3)
        a, b = await queue.enter(), await queue.enter()
        order: list[str] = []

        async def whole() -> None:
            t = await queue.enter_all()
            order.append("whole")
            queue.leave(t, 3)

        async def single() -> None:
            t = await queue.enter()
            order.append("single")
            queue.leave(t)

        async with anyio.create_task_group() as tg:
            tg.start_soon(whole)
            await _until(lambda: queue.waiting == 1)
            assert order == []  # one slot is free, but the whole model needs all three
            tg.start_soon(single)  # arrives after: waits behind the whole-model holder
            await _until(lambda: queue.waiting == 2)
            queue.leave(a)
            queue.leave(b)
        assert order == ["whole", "single"] and queue.running == 0

    anyio.run(main)


def test_two_whole_model_holders_do_not_deadlock():
    async def main() -> None:
        queue = RequestQueue(4, 2)
        done: list[int] = []

        async def whole(i: int) -> None:
            t = await queue.enter_all()
            await anyio.sleep(0)
            done.append(i)
            queue.leave(t, 2)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(whole, i)
        assert sorted(done) == [0, 1, 2] and queue.running == 0

    anyio.run(main)
