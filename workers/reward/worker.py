"""The reward worker: claims finished samples over the API, scores them with a verifier and
posts the rewards (which places complete groups into buffers)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from workers.client import Conflict, StaleFlowClient
from workers.tasks.verifiers import VERIFIERS, Detokenize, bytes_detokenize

log = logging.getLogger("staleflow.reward")


@dataclass
class RewardStats:
    scored: int = 0
    lost: int = 0  # claims that expired before we posted (409)
    groups_occupied: int = 0
    groups_filtered: int = 0
    reward_sum: float = 0.0


class RewardWorker:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        verifier: str = "repeat",
        *,
        detokenize: Detokenize = bytes_detokenize,
        batch: int = 256,
        wait_s: float = 1.0,
        claim_s: float = 60.0,
    ):
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r} (known: {', '.join(sorted(VERIFIERS))})")
        self.client, self.run_id, self.verify = client, run_id, VERIFIERS[verifier]
        self.detokenize, self.batch, self.wait_s, self.claim_s = detokenize, batch, wait_s, claim_s
        self.stats = RewardStats()
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def run(self, until: Callable[[], bool] | None = None) -> RewardStats:
        while not self._stop and not (until and until()):
            self.step()
        return self.stats

    def step(self) -> int:
        tasks = self.client.claim(self.run_id, limit=self.batch, claim_seconds=self.claim_s, wait=self.wait_s)
        if not tasks:
            return 0
        rewards = [
            (
                t.sample_id,
                t.reward_attempt,
                float(self.verify(t.response_tokens, t.finish_reason, t.meta, self.detokenize)),
            )
            for t in tasks
        ]
        while rewards:
            try:
                outcomes = self.client.record_rewards(self.run_id, rewards)
                break
            except Conflict as e:  # claims that expired meanwhile: someone else scores them
                lost = {item["id"] for item in e.items}
                if not lost:
                    raise
                self.stats.lost += len(lost)
                rewards = [r for r in rewards if r[0] not in lost]
        else:
            return 0
        self.stats.scored += len(rewards)
        self.stats.reward_sum += sum(r[2] for r in rewards)
        self.stats.groups_occupied += sum(o.state == "occupied" for o in outcomes)
        self.stats.groups_filtered += sum(o.state == "filtered" for o in outcomes)
        return len(rewards)
