"""Long-polls answered at once when the server is told to stop.

On SIGTERM or SIGINT uvicorn stops accepting connections and waits for the requests in progress
(`timeout_graceful_shutdown`, 5 s) before it cancels them: an open long-poll (up to `max_wait`,
30 s) held every replica's stop for those 5 s and then ended without a response, which its
client read as an outage. Chained in front of uvicorn's own handler, `drain_on_signals` makes
the notifier drain: every long-poll answers what it has (usually nothing) at once, with the
connection closing after the response, and the client polls again, another replica or this one
restarted. A rolling restart of the replicas then costs the workers no error and no wait.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from .notify import Notifier

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def drain_on_signals(notifier: Notifier) -> Callable[[], None]:
    """Install the handlers (in the main thread only: elsewhere, e.g. a server in a test's
    thread, signals are not this process's to take); returns what puts the previous ones back.
    The previous handler still runs (uvicorn's starts its shutdown); a default one is restored
    and the signal raised again, an ignored one stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}

    def handler(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(notifier.drain)
        before = previous[sig]
        if callable(before):
            before(sig, frame)
        elif before == signal.SIG_DFL:
            signal.signal(sig, before)
            signal.raise_signal(sig)

    for sig in SIGNALS:
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, before in previous.items():
            signal.signal(sig, before)

    return restore
