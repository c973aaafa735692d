"""The process-local wake-ups of long-polls (api/notify.py): a topic wakes its own waiters and
its subtopics' (`work` wakes every `work:<instance>`), nothing else, and keeps doing so for
the events taken after a wake."""

from __future__ import annotations

import asyncio

from api.notify import REWARDS, WORK, Notifier, instance_topic


async def _published(n: Notifier, run_id: int, *topics: str) -> None:
    n.publish(run_id, *topics)
    await asyncio.sleep(0)  # publish hands the wake to the loop (it may come from any thread)


def test_a_topic_wakes_its_subtopics_and_nothing_else():
    async def go() -> None:
        n = Notifier(None, None, 0.0, listen=False)  # type: ignore[arg-type]
        await n.start()
        one, two = n.event(1, instance_topic(1)), n.event(1, instance_topic(2))
        other_run, rewards = n.event(2, instance_topic(1)), n.event(1, REWARDS)

        await _published(n, 1, instance_topic(1))
        assert one.is_set() and not two.is_set()

        again = n.event(1, instance_topic(1))  # a new wait after the wake: a fresh event
        assert again is not one and not again.is_set()
        await _published(n, 1, WORK)
        assert again.is_set() and two.is_set()
        assert not other_run.is_set() and not rewards.is_set()

        third = n.event(1, instance_topic(1))
        await _published(n, 1, REWARDS)
        assert rewards.is_set() and not third.is_set()
        await _published(n, 1, WORK)
        assert third.is_set()
        await _published(n, 2, WORK)
        assert other_run.is_set()
        await n.stop()

    asyncio.run(go())


def test_every_waiter_wakes_on_drain_and_later_events_still_follow_their_topic():
    async def go() -> None:
        n = Notifier(None, None, 0.0, listen=False)  # type: ignore[arg-type]
        await n.start()
        waiting = [n.event(1, instance_topic(i)) for i in range(1, 4)] + [n.event(1, REWARDS)]
        n.drain()
        assert all(e.is_set() for e in waiting)
        after = n.event(1, instance_topic(1))
        await _published(n, 1, WORK)
        assert after.is_set()
        await n.stop()

    asyncio.run(go())
