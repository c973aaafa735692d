"""The named retry policies (workers/retry.py): their waits, when they give up, what they retry."""

from __future__ import annotations

import asyncio
import logging

import pytest

from workers.retry import API_OUTAGE, READY, RESTART, TRANSACTION_CONFLICT, Outage, Policy

FAST = Policy("test", initial=0.001, cap=0.004)


def test_waits_double_up_to_the_cap() -> None:
    assert [RESTART.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    for n in range(1, 10):  # jitter adds at most `jitter` seconds, never past the cap
        base = min(API_OUTAGE.initial * 2 ** (n - 1), API_OUTAGE.cap)
        assert base <= API_OUTAGE.delay(n) <= min(base + API_OUTAGE.jitter, API_OUTAGE.cap)
    assert {READY.but(initial=0.2, cap=0.2).delay(n) for n in range(1, 5)} == {0.2}


def test_full_jitter_waits_anywhere_up_to_the_doubling_wait() -> None:
    policy = TRANSACTION_CONFLICT  # 10 ms doubling to 320 ms, full jitter
    for n in range(1, 9):
        bound = min(policy.initial * 2 ** (n - 1), policy.cap)
        waits = [policy.delay(n) for _ in range(200)]
        assert all(0 <= w <= bound for w in waits)
        # spread over the whole window, not bunched at its top as added jitter would be
        assert min(waits) < bound / 4 and max(waits) > bound * 3 / 4
    with pytest.raises(ValueError, match="full jitter replaces"):
        Policy("both", initial=0.1, cap=1.0, jitter=0.1, full_jitter=True)


def test_retries_what_is_retryable_and_raises_the_rest() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "up"

    assert FAST.retrying(retryable=lambda e: isinstance(e, ConnectionError))(flaky) == "up"
    assert len(calls) == 3

    def refused() -> None:
        calls.append(1)
        raise ValueError("no")

    calls.clear()
    with pytest.raises(ValueError):
        FAST.retrying(retryable=lambda e: isinstance(e, ConnectionError))(refused)
    assert len(calls) == 1  # a refusal is not retried


def test_gives_up_after_attempts_or_time_with_the_last_error_or_give_up() -> None:
    calls: list[int] = []

    def down() -> None:
        calls.append(1)
        raise ConnectionError(f"try {len(calls)}")

    with pytest.raises(ConnectionError, match="try 4"):
        FAST.but(attempts=4).retrying(retryable=lambda e: True)(down)
    calls.clear()
    with pytest.raises(ConnectionError, match="try 1"):
        FAST.but(retry_for=0).retrying(retryable=lambda e: True)(down)  # one try
    assert FAST.but(attempts=2).retrying(retryable=lambda e: True, give_up=lambda state: "gave up")(down) == "gave up"


def test_until_retries_results_and_stopping_ends_it() -> None:
    values = iter([0, 0, 5])
    assert FAST.retrying(until=bool)(lambda: next(values)) == 5
    asked = [False]

    def never() -> int:
        asked[0] = True  # stop from the first failed attempt on
        return 0

    assert FAST.retrying(until=bool, stopping=lambda: asked[0], give_up=lambda state: -1)(never) == -1
    with pytest.raises(TypeError, match="nothing to retry on"):
        FAST.retrying()


def test_an_outage_logs_once_down_and_once_back(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage("the thing", logging.getLogger("test.retry"))
    failures = iter([ConnectionError("refused"), ConnectionError("refused"), None])

    def attempt() -> str:
        exc = next(failures)
        if exc is not None:
            raise exc
        return "ok"

    with caplog.at_level(logging.INFO, logger="test.retry"):
        assert FAST.retrying(outage, lambda e: isinstance(e, ConnectionError))(attempt) == "ok"
        assert outage.down and outage.count == 1
        outage.ok()
    assert not outage.down
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the retry in between logs at debug level only
    assert "the thing unavailable (ConnectionError: refused)" in lines[0] and "the thing is back" in lines[1]


def test_async_controller() -> None:
    tries: list[int] = []

    async def connect() -> str:
        tries.append(1)
        if len(tries) < 2:
            raise OSError("refused")
        return "listening"

    assert asyncio.run(FAST.async_retrying(retryable=lambda e: isinstance(e, OSError))(connect)) == "listening"
