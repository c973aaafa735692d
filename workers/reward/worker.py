"""The reward worker: claims finished samples over the API, scores them (a verifier, the user's
function or a reward service: sources.py) and posts the rewards (which places complete groups
into buffers). A sample whose reward keeps failing (raises, is not a reward, times out) after
the retries of the REWARD_CALL policy is dropped through the API as `reward_failed`: never
lost, never scored 0 in silence."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from workers.client import Conflict, StaleFlowClient
from workers.extras import require
from workers.retry import REWARD_CALL, Policy
from workers.tasks.verifiers import NEEDS, VERIFIERS, Detokenize, bytes_detokenize

from .sources import Outcome, RewardSample, RewardSource, Scored, VerifierReward

log = logging.getLogger("staleflow.reward")

# After a claim that took fewer samples than the batch, the next claim waits until this long
# after it: finished samples then reach a worker a few per claim, not one claim and one reward
# post each (bench/capacity.py at 128 instances: reward calls per sample ~1.4 -> ~0.45). A
# claim that takes a whole batch is followed at once (a backlog), and a long-poll that found
# nothing is simply renewed.
CLAIM_LINGER_S = 0.25


@dataclass
class RewardStats:
    scored: int = 0
    dropped: int = 0  # rewards that kept failing: dropped as reward_failed
    failures: int = 0  # failed tries, retried or not
    lost: int = 0  # claims that expired before we posted (409)
    groups_occupied: int = 0
    groups_filtered: int = 0
    reward_sum: float = 0.0


def describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return f"timed out after {timeout:g} s"
    return f"{type(exc).__name__}: {exc}"[:500]


def verifier_source(name: str, detokenize: Detokenize = bytes_detokenize) -> VerifierReward:
    """A registered verifier, its optional package checked now (the error names the extra)."""
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r} (known: {', '.join(sorted(VERIFIERS))})")
    if name in NEEDS:
        require(NEEDS[name])
    return VerifierReward(name, detokenize)


class RewardWorker:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        verifier: str | RewardSource = "repeat",
        *,
        detokenize: Detokenize = bytes_detokenize,
        batch: int = 256,
        wait_s: float = 1.0,
        claim_s: float = 60.0,
        timeout_s: float = 30.0,
        retry: Policy = REWARD_CALL,
        linger_s: float = CLAIM_LINGER_S,
    ):
        self.source = verifier_source(verifier, detokenize) if isinstance(verifier, str) else verifier
        self.client, self.run_id = client, run_id
        self.detokenize, self.batch, self.wait_s, self.claim_s = detokenize, batch, wait_s, claim_s
        self.timeout_s, self.retry, self.linger_s = timeout_s, retry, linger_s
        self.stats = RewardStats()
        self._stopped = threading.Event()  # set by stop(); wakes a linger
        self._next_claim = 0.0  # monotonic time before which the next claim lingers
        self._loop = asyncio.Runner()  # one loop for the worker's life: a service's connections stay open

    def stop(self) -> None:
        self._stopped.set()

    def close(self) -> None:
        self._loop.run(self.source.aclose())
        self._loop.close()

    def run(self, until: Callable[[], bool] | None = None) -> RewardStats:
        try:
            while not self._stopped.is_set() and not (until and until()):
                self.step()
        finally:
            self.close()
        return self.stats

    def sample(self, t) -> RewardSample:
        return RewardSample(
            run_id=self.run_id,
            sample_id=t.sample_id,
            group_id=t.group_id,
            prompt_tokens=list(t.prompt_tokens),
            response_tokens=list(t.response_tokens),
            prompt=self.detokenize(t.prompt_tokens),
            response=self.detokenize(t.response_tokens),
            finish_reason=t.finish_reason,
            meta=dict(t.meta),
            response_mask=list(getattr(t, "response_mask", [])),
        )

    async def score(self, samples: Sequence[RewardSample]) -> dict[int, Outcome]:
        """Each sample's reward, or its last error after the policy's tries (only the samples
        that failed are tried again); a sample still to be retried when the worker stops is
        left out."""
        got: dict[int, Outcome] = {}
        pending, attempt = list(samples), 0
        while pending:
            attempt += 1
            outcomes = await self.source.score(pending, self.timeout_s)
            failed = []
            for s, o in zip(pending, outcomes, strict=True):
                got[s.sample_id] = o
                if not isinstance(o, Scored):
                    failed.append(s)
                    self.stats.failures += 1
                    log.debug(
                        "reward of sample %d failed (try %d): %s", s.sample_id, attempt, describe(o, self.timeout_s)
                    )
            pending = failed
            if not pending or (self.retry.attempts is not None and attempt >= self.retry.attempts):
                break
            if self._stopped.is_set():  # not given up on: left to expire, so another claim scores them
                for s in pending:
                    del got[s.sample_id]
                break
            await asyncio.sleep(self.retry.delay(attempt))
        return got

    def step(self) -> int:
        """Claim (after the linger a partial claim left, see CLAIM_LINGER_S), score, post: the
        samples rewarded or dropped."""
        pause = self._next_claim - time.monotonic()
        if pause > 0 and self._stopped.wait(pause):
            return 0
        tasks = self.client.claim(self.run_id, limit=self.batch, claim_seconds=self.claim_s, wait=self.wait_s)
        self._next_claim = time.monotonic() + self.linger_s if 0 < len(tasks) < self.batch else 0.0
        if not tasks:
            return 0
        attempts = {t.sample_id: t.reward_attempt for t in tasks}
        got = self._loop.run(self.score([self.sample(t) for t in tasks]))
        rewards = []
        drops = []
        for sid, o in got.items():
            if isinstance(o, Scored):
                rewards.append((sid, attempts[sid], o.reward, o.metrics))
            else:
                log.warning("dropping sample %d (reward_failed): %s", sid, describe(o, self.timeout_s))
                drops.append((sid, attempts[sid]))
        rewards = self._post(lambda batch: self.client.record_rewards(self.run_id, batch), rewards)
        drops = self._post(lambda batch: self.client.drop_rewards(self.run_id, batch), drops)
        self.stats.dropped += len(drops)
        self.stats.scored += len(rewards)
        self.stats.reward_sum += sum(r[2] for r in rewards)
        return len(rewards) + len(drops)

    def _post(self, call: Callable[[list], object], items: list) -> list:
        """Post `items`, less those whose claim expired meanwhile (someone else scores them)."""
        while items:
            try:
                outcomes = call(items)
                break
            except Conflict as e:
                lost = {item["id"] for item in e.items}
                if not lost:
                    raise
                self.stats.lost += len(lost)
                items = [r for r in items if r[0] not in lost]
        else:
            return []
        if isinstance(outcomes, list):
            self.stats.groups_occupied += sum(getattr(o, "state", None) == "occupied" for o in outcomes)
            self.stats.groups_filtered += sum(getattr(o, "state", None) == "filtered" for o in outcomes)
        return items
