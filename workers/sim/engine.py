"""A simulated rollout instance: the shared batching model on an event-driven clock.

The batch — admission with a KV watermark, decode timing from the cost model, preemption of
the most recently admitted sample (or, with φ_wait, its interruption back to the central
queue) — is `workers.rollout.engines.timing.BatchModel`, the model the live `sim` engine
runs too. This class adds the simulator's clock: between discrete events (a finish, the KV
cache filling up, the end of a prefill or a pull) nothing but KV growth happens, so it jumps
straight to the next event in one arithmetic step. Also modelled here: prefill time for every
admission (context tokens / prefill rate; decoding pauses meanwhile), interrupts (a sample
leaves with the tokens it has) and pulls (interrupt everything, load weights for
`pull_time`, resume at the new version).

Sample data live in a shared `SampleTable` (plain lists indexed by sample id), so engines,
the simulator and reports read the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from workers.coordinator.cost_model import CostModel
from workers.coordinator.state import InstanceSnapshot, RunningSample
from workers.rollout.engines.timing import BatchModel


class _LazyRunning(Sequence):
    """Per-running-sample details of a snapshot, built only if someone reads them (the
    migration strategy, rarely): the snapshot keeps the engine's (immutable) records."""

    __slots__ = ("_items", "_it", "_vtraj", "_cache")

    def __init__(self, items: tuple, it: int, vtraj: list):
        self._items: tuple | None = items
        self._it, self._vtraj = it, vtraj
        self._cache: tuple[RunningSample, ...] | None = None

    def _get(self) -> tuple[RunningSample, ...]:
        if self._cache is None:
            it, vt = self._it, self._vtraj
            cache = tuple(RunningSample(sid, r[2] + it, r[1] + it, vt[sid]) for sid, r in self._items or ())
            self._cache, self._items = cache, None
            return cache
        return self._cache

    def __len__(self) -> int:
        return len(self._items or ()) if self._cache is None else len(self._cache)

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())


class SampleTable:
    """Per-sample numbers, indexed by the protocol's sample id (ids are 1, 2, ...)."""

    def __init__(self) -> None:
        self.group = [0]
        self.prompt = [0]
        self.target = [0]  # response length it will reach
        self.gen = [0]  # response tokens generated (as of its last admission/removal)
        self.seg0 = [0]  # `gen` when its current segment started
        self.v_traj = [0]
        self.attempt = [0]
        self.instance = [0]  # engine holding it (0: none)
        self.seg_version = [0]
        self.last_version: list[int | None] = [None]  # version of the latest segment with tokens
        self.ran_on = [0]  # instance of its latest segment

    def add(self, sid: int, group: int, prompt: int, target: int) -> None:
        if sid != len(self.group):
            raise ValueError(f"sample ids must be contiguous: got {sid}, expected {len(self.group)}")
        cols: tuple[tuple[list, int | None], ...] = (
            (self.group, group),
            (self.prompt, prompt),
            (self.target, target),
            (self.gen, 0),
            (self.seg0, 0),
            (self.v_traj, 0),
            (self.attempt, 0),
            (self.instance, 0),
            (self.seg_version, 0),
            (self.last_version, None),
            (self.ran_on, 0),
        )
        for lst, v in cols:
            lst.append(v)


class SimInstance:
    def __init__(
        self,
        iid: int,
        cost: CostModel,
        kv_capacity: int,
        max_running: int,
        prefill_rate: float,
        table: SampleTable,
        version: int = 0,
        phi_wait: int | None = None,
        attn_coef: float = 0.0,
    ):
        self.id = iid
        self.cost = cost
        self.batch = BatchModel(cost, kv_capacity, max_running, table, attn_coef)
        self.cap, self.max_running = self.batch.cap, self.batch.max_running
        self.prefill_rate = float(prefill_rate)
        self.table = table
        self.version = version
        self.phi_wait = phi_wait
        self.t = 0.0  # local clock: the end of the last whole iteration (or of the last state change)
        self.stall_until = 0.0
        self.pulling_until: float | None = None
        self.pull_version = version  # the version being loaded while `pulling_until` is set
        self.received = 0
        # outbox, drained by the simulator
        self.finished: list[int] = []
        self.interrupted: list[int] = []  # by the φ_wait rule
        self.pulled = False
        # metrics
        self.busy = 0.0  # decoding or prefilling
        self.idle = 0.0
        self.pull_total = 0.0
        self.tokens = 0  # decoded tokens
        self.prefill_tokens = 0.0  # token-equivalents (attention included)
        self._hb_tokens = 0
        self._hb_t = 0.0

    @property
    def n(self) -> int:
        return self.batch.n

    @property
    def kv(self) -> int:
        return self.batch.kv

    @property
    def waiting(self):
        return self.batch.waiting

    @property
    def preemptions(self) -> int:
        return self.batch.preemptions

    @property
    def pulling(self) -> bool:
        return self.pulling_until is not None

    # ---- inputs ----------------------------------------------------------------------------

    def add(self, sid: int, now: float) -> None:
        """A routed sample arrives (it joins at the next iteration boundary)."""
        if not self.batch.run and self.pulling_until is None and self.t < now:
            self.idle += now - self.t
            self.t = now
        self.batch.waiting.append(sid)
        self.table.instance[sid] = self.id
        self.received += 1

    def interrupt(self, sids, now: float) -> list[int]:
        """Take samples off the engine with the tokens they have; returns those it held."""
        out = self.batch.remove(sids)
        for sid in out:
            self.table.instance[sid] = 0
        return out

    def start_pull(self, now: float, version: int, duration: float) -> list[int]:
        """Interrupt everything, then load `version` for `duration` seconds."""
        out = self.interrupt(list(self.batch.run) + list(self.batch.waiting), now)
        if self.t < now:
            # the iteration in flight is lost; the time since the last boundary was spent
            self.busy += now - self.t
            self.t = now
        self.stall_until = now
        self.pulling_until = now + duration
        self.pull_version = version
        return out

    # ---- the clock -------------------------------------------------------------------------

    def _admit(self) -> None:
        prefill = self.batch.admit()
        if prefill:
            start = self.stall_until if self.stall_until > self.t else self.t
            self.stall_until = start + prefill / self.prefill_rate
            self.prefill_tokens += prefill

    def _preempt(self) -> None:
        sid, interrupted = self.batch.preempt(self.phi_wait)
        if interrupted:
            self.table.instance[sid] = 0
            self.interrupted.append(sid)

    def advance(self, T: float) -> None:
        """Run the engine up to time T (it stops at the last iteration boundary <= T)."""
        b = self.batch
        while True:
            if self.pulling_until is not None:
                if self.pulling_until > T:
                    self.pull_total += T - self.t
                    self.t = T
                    return
                self.pull_total += self.pulling_until - self.t
                self.t = self.pulling_until
                self.version = self.pull_version
                self.pulling_until = None
                self.pulled = True
            if b.waiting:
                self._admit()
            if self.stall_until > self.t:
                if self.stall_until >= T:
                    self.busy += T - self.t
                    self.t = T
                    return
                self.busy += self.stall_until - self.t
                self.t = self.stall_until
            n = len(b.run)
            if n == 0:
                if T > self.t:
                    self.idle += T - self.t
                    self.t = T
                return
            k_kv = b.room()
            if k_kv <= 0:
                self._preempt()
                continue
            k_fin = b.to_finish()
            k = k_fin if k_fin < k_kv else k_kv
            budget = T - self.t
            dt = b.time(k)
            partial = False
            if dt > budget:
                k = b.within(budget)
                if k <= 0:
                    return
                dt = b.time(k)
                partial = True
            self.t += dt
            self.busy += dt
            self.tokens += k * n
            done = b.decode(k)
            if done:
                instance = self.table.instance
                for sid in done:
                    instance[sid] = 0
                self.finished.extend(done)
            if partial:
                return

    def next_event_time(self) -> float:
        """When the next finish / preemption / pull end would happen with no new input."""
        if self.pulling_until is not None:
            return self.pulling_until
        b = self.batch
        if not b.run:
            return self.t if b.waiting else math.inf
        k = b.to_finish()
        k_kv = b.room()
        if k_kv < k:
            k = max(k_kv, 1)
        start = self.stall_until if self.stall_until > self.t else self.t
        return start + b.time(k)

    # ---- reporting -------------------------------------------------------------------------

    def segment_tokens(self, sid: int) -> int:
        return self.table.gen[sid] - self.table.seg0[sid]

    def snapshot(self, now: float, detail: bool = True) -> InstanceSnapshot:
        b = self.batch
        n = len(b.run)
        it = b.it
        samples: Sequence[RunningSample] = ()
        if detail and n:
            samples = _LazyRunning(tuple(b.run.items()), it, self.table.v_traj)
        dt = now - self._hb_t
        thr = (self.tokens - self._hb_tokens) / dt if dt > 0 else 0.0
        self._hb_t, self._hb_tokens = now, self.tokens
        return InstanceSnapshot(
            instance_id=self.id,
            version=self.version,
            running=n,
            waiting=len(b.waiting),
            kv_used=b.kv,
            kv_capacity=self.cap,
            running_samples=samples,
            throughput=thr,
            heartbeat_at=now,
            snapshot_at=now,
            pulling=self.pulling_until is not None,
            routed_seen=self.received,
            max_running=self.max_running,
        )
