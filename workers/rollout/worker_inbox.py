"""The rollout worker's inbox: one thread keeps a long-poll open for the worker's instance.

The worker's own thread is busy stepping the engine (a step is tens of milliseconds), so a poll
between steps delivers a command only after the step, the reports and the poll's own round trip.
Long-polling from a thread of its own, the worker receives a command as soon as the coordinator's
NOTIFY wakes the API; the worker applies it at its next step boundary. Only this thread polls;
the engine is touched by the worker's thread alone. A poll renews the instance's lease, so it
polls only while `alive()` (the worker's loop ticks): a hung engine lets its lease lapse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.client import Conflict, StaleFlowClient
from workers.wire import models as m

log = logging.getLogger("staleflow.rollout")


@dataclass(frozen=True)
class Delivery:
    """What one poll of `instance_id` returned (or raised), and when it arrived."""

    instance_id: int
    out: m.PollOut | None
    error: BaseException | None
    received_at: float


class Inbox:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        instance: Callable[[], int | None],
        wait_s: float,
        alive: Callable[[], bool] = lambda: True,
    ):
        self.client, self.run_id, self.instance, self.wait_s, self.alive = client, run_id, instance, wait_s, alive
        self.last_poll = 0.0  # monotonic time the latest poll was sent
        self._q: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Send no further poll. The one in flight still ends; what it delivers is not read
        (the instance's deregistration requeues it, or refuses the poll if it comes first)."""
        self._stop.set()

    def close(self) -> None:
        """Stop polling; waits for the poll in flight (at most `wait_s` plus a round trip: the
        instance's deregistration answers it at once)."""
        self._stop.set()
        self._thread.join(self.wait_s + 5.0)

    def get(self, timeout: float) -> list[Delivery]:
        """Everything delivered so far; waits up to `timeout` seconds for the first one."""
        out: list[Delivery] = []
        try:
            out.append(self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait())
            while True:
                out.append(self._q.get_nowait())
        except queue.Empty:
            return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            inst = self.instance()
            if inst is None or not self.alive():
                self._stop.wait(0.01)
                continue
            self.last_poll = time.monotonic()
            try:
                out = self.client.poll(self.run_id, inst, wait=self.wait_s)
            except Conflict as exc:  # fenced: the worker registers again; poll the new instance then
                if self._stop.is_set():
                    return
                self._q.put(Delivery(inst, None, exc, time.monotonic()))
                while self.instance() == inst and not self._stop.wait(0.01):
                    pass
                continue
            except BaseException as exc:  # the worker's thread raises it
                if not self._stop.is_set():
                    self._q.put(Delivery(inst, None, exc, time.monotonic()))
                return
            if out.work or out.commands:
                self._q.put(Delivery(inst, out, None, time.monotonic()))
