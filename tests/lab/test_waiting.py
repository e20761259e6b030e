"""wait_until and wait_until_async: the predicate's value back on success; on a timeout, an
error that names what was awaited and what the predicate last answered or raised."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from controlplane.lab.waiting import WaitTimeout, wait_until, wait_until_async


def test_the_first_truthy_answer_is_returned() -> None:
    answers = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(answers), 30, "a number", every_s=0) == 7


def test_a_timeout_names_what_was_awaited_and_the_last_answer() -> None:
    counter = itertools.count()
    with pytest.raises(WaitTimeout) as caught:
        wait_until(lambda: next(counter) < 0 and "never", 0.05, "a negative count", every_s=0.01)
    assert "a negative count" in str(caught.value) and caught.value.last is False


def test_ignored_errors_are_not_yet_and_others_propagate() -> None:
    tries = itertools.count()

    def refused_twice() -> str:
        if next(tries) < 2:
            raise ConnectionRefusedError("not listening yet")
        return "up"

    assert wait_until(refused_twice, 30, "a listener", every_s=0, ignore=(OSError,)) == "up"
    with pytest.raises(WaitTimeout) as caught:
        wait_until(lambda: [][0], 0.05, "an item", every_s=0.01, ignore=(IndexError,))
    assert isinstance(caught.value.last, IndexError)
    empty: dict[str, int] = {}
    with pytest.raises(KeyError):
        wait_until(lambda: empty["x"], 30, "a key", ignore=(OSError,))


def test_the_async_wait_lets_other_tasks_run_between_tries() -> None:
    async def scenario() -> None:
        seen: list[int] = []

        async def producer() -> None:
            for i in range(3):
                await asyncio.sleep(0)
                seen.append(i)

        task = asyncio.create_task(producer())
        assert await wait_until_async(lambda: len(seen) == 3 and seen, 30, "three items",
                                      every_s=0) == [0, 1, 2]
        await task
        with pytest.raises(WaitTimeout, match="a fourth item"):
            await wait_until_async(lambda: len(seen) > 3, 0.05, "a fourth item", every_s=0.01)

    asyncio.run(scenario())
