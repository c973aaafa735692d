"""The parameter server's egress in the simulator: pulls that start together share it.

The PS sends weights point to point (each instance pulls on its own schedule) through its
NICs: at most `streams` transfers run at an instance's full rate. The pulls one coordinator
cycle starts share the egress fairly and so finish together, after as many rounds of
`transfer_s` as the streams need to carry them all; pulls started later queue behind the
bytes already promised (first come first served). A policy that pulls every instance at every
version (strict) waits for those rounds on every publish; one whose pulls are spread out moves
each at full rate. `streams=None` is the old model: every pull at full rate, no limit.
"""

from __future__ import annotations

import heapq


class PSEgress:
    def __init__(self, streams: int | None, transfer_s: float, reload_s: float):
        self.transfer_s, self.reload_s = transfer_s, reload_s
        self._stream_free: list[float] | None = [0.0] * streams if streams else None

    def pull_durations(self, now: float, count: int) -> float:
        """Seconds from `now` until `count` pulls starting now have their weights loaded."""
        if self._stream_free is None or count == 0:
            return self.transfer_s + self.reload_s
        end = now
        for _ in range(count):  # the bytes of the cohort, spread over the streams as they free up
            start = max(now, heapq.heappop(self._stream_free))
            heapq.heappush(self._stream_free, start + self.transfer_s)
            end = max(end, start + self.transfer_s)
        return end - now + self.reload_s
