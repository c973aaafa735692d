"""The simulated trainer: consumes the ready buffer of the run's version, trains for a
tokens-proportional time (`Setup.train_step_time`), publishes (the PS then holds the new
version), and keeps the per-step figures `build_result` reports."""

from __future__ import annotations

from collections import Counter

from workers.wire.enums import GroupState, SampleState

from .engine import SampleTable
from .protocol import SimProtocol
from .setups import Setup


class SimTrainer:
    def __init__(self, p: SimProtocol, table: SampleTable, setup: Setup):
        self.p, self.table, self.setup = p, table, setup
        self.until: float | None = None  # virtual time the step in progress ends
        self.batch: tuple[int, int, list[int]] | None = None  # (version, consume fence, groups)
        self.busy = 0.0
        self.publish_times: list[float] = []
        self.train_times: list[float] = []
        self.step_tokens: list[int] = []
        self.step_samples: list[int] = []
        self.staleness: Counter[int] = Counter()  # trained groups by b - V_group (published steps)
        self.sample_staleness: Counter[int] = Counter()  # trained samples by b - V_traj
        self._step_staleness: tuple[Counter[int], Counter[int]] = (Counter(), Counter())  # the step in progress
        self.trained_prompt_tokens = 0

    def publish_due(self, now: float) -> list[int] | None:
        """Publish the step in progress if it has ended by `now`: the groups the protocol
        aborted on that publish (their samples must leave engines and queue), None if no publish."""
        if self.until is None or now < self.until - 1e-9:
            return None
        assert self.batch is not None  # set with until
        p = self.p
        v, fence, _ = self.batch
        in_flight = list(p.reserved)
        p.publish(v, fence)
        self.publish_times.append(now)
        self.staleness.update(self._step_staleness[0])
        self.sample_staleness.update(self._step_staleness[1])
        self.until = self.batch = None
        doomed = p.abort_after_ready()
        # consumed buffers can strand reservations (B' > B): publish may abort those groups
        stranded = [gid for gid in in_flight if p.groups[gid].state == GroupState.ABORTED]
        return doomed + stranded

    def start_step(self, now: float) -> bool:
        """When idle, consume the ready buffer of the run's version; True if a step started."""
        if self.until is not None:
            return False
        p = self.p
        res = p.consume(p.version)
        if res is None:
            return False
        fence, gids = res
        b = p.version
        tokens = prompt_tokens = samples = 0
        tbl = self.table
        groups_by, samples_by = self._step_staleness = (Counter(), Counter())
        for gid in gids:
            g = p.groups[gid]
            assert g.group_version is not None  # a consumed group has its version
            groups_by[b - g.group_version] += 1
            for sid in g.sample_ids:
                s = p.samples[sid]
                if s.state == SampleState.REWARDED:
                    assert s.v_traj is not None  # it was routed
                    tokens += tbl.gen[sid]
                    prompt_tokens += tbl.prompt[sid]
                    samples += 1
                    samples_by[b - s.v_traj] += 1
        self.step_tokens.append(tokens)
        self.step_samples.append(samples)
        self.trained_prompt_tokens += prompt_tokens
        dt = self.setup.train_step_time(tokens + prompt_tokens)
        self.train_times.append(dt)
        # then the trainer waits while the new weights go to the PS; the version exists after that
        self.busy += dt + self.setup.push_time
        self.until = now + dt + self.setup.push_time
        self.batch = (b, fence, gids)
        return True
