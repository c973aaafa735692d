"""The reference protocol as the simulator uses it.

`SimProtocol` is `staleflow_db.reference.ReferenceProtocol` unchanged, plus one index:
`claim_rewards` in the reference sorts *every* sample ever created on each call, which makes
a paper-scale simulation (tens of thousands of samples, a claim per finished batch)
quadratic. The subclass remembers which samples became FINISHED and hands the base method
only those candidates — the claim logic itself is the reference's.

(The same index inside `ReferenceProtocol` would make this subclass unnecessary.)
"""

from __future__ import annotations

from typing import Iterable

from staleflow_db.enums import SampleState, SegmentKind
from staleflow_db.reference import ReferenceProtocol
from staleflow_db.types import Report, RunConfig


class SimProtocol(ReferenceProtocol):
    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._finished: set[int] = set()

    def report(self, reports: list[Report]) -> None:
        super().report(reports)
        for r in reports:
            if r.kind == SegmentKind.FINISHED:
                self._finished.add(r.sample_id)

    def release_reward_claims(self, sample_ids: Iterable[int]) -> None:
        sample_ids = list(sample_ids)
        super().release_reward_claims(sample_ids)
        self._finished.update(sample_ids)

    def claim_rewards(self, limit: int) -> list[tuple[int, int]]:
        full = self.samples
        candidates = {sid: full[sid] for sid in self._finished if full[sid].state == SampleState.FINISHED}
        self.samples = candidates
        try:
            claimed = super().claim_rewards(limit)
        finally:
            self.samples = full
        self._finished = {sid for sid in self._finished if full[sid].state == SampleState.FINISHED}
        return claimed
