"""`staleflow_protocol_transaction_cpu_seconds_total`: the CPU of the thread that ran a protocol
transaction, by operation: what a transaction computes counts, what it waits for does not."""

from __future__ import annotations

import threading
import time

import pytest

from api.metrics import Metrics


def _cpu(metrics: Metrics, operation: str) -> float:
    value = metrics.registry.get_sample_value(
        "staleflow_protocol_transaction_cpu_seconds_total", {"operation": operation}
    )
    assert value is not None, operation
    return value


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_transaction_counts_its_threads_cpu_not_its_waits_nor_other_threads():
    metrics = Metrics(lambda: 1 / 0)  # the database figures are not read here
    stop = threading.Event()
    other = threading.Thread(target=lambda: [_burn(0.01) for _ in iter(stop.is_set, True)])
    other.start()  # another thread busy meanwhile: none of its CPU is the transaction's
    try:
        with metrics.observe("busy"):
            _burn(0.05)
        with metrics.observe("waiting"):
            time.sleep(0.2)  # as a transaction waiting on the database
        with pytest.raises(ValueError), metrics.observe("refused"):
            _burn(0.02)
            raise ValueError("refused")  # a refusal's CPU counts too
    finally:
        stop.set()
        other.join()
    assert 0.05 <= _cpu(metrics, "busy") < 0.15
    assert _cpu(metrics, "waiting") < 0.02
    assert 0.02 <= _cpu(metrics, "refused") < 0.1
