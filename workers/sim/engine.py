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

Multi-turn trajectories (an agentic workload): the batch model runs one turn at a time — a
sample's `target` is the end of its current turn. When a turn ends with more to come, the
trajectory leaves the batch and waits for its environment on this instance, holding no decode
slot and no KV the batch counts: its context stays in the engine's prefix cache (vLLM's
automatic prefix caching, SGLang's radix cache keep a finished request's blocks as evictable).
When the environment answers, the observation is appended to the context and the trajectory
rejoins the waiting queue for its next turn; admission then prefills only the observation (and
its attention over the cached context) if the cache is still valid here — same instance, same
weights — and the whole context otherwise (it was interrupted or migrated between turns, or a
pull reset the cache). Eviction under memory pressure is not modelled (an optimistic cache,
the same for every policy). A pull or an interrupt takes waiting trajectories off the engine
too; their environment call goes on, and the simulator queues them once it answers.

Sample data live in a shared `SampleTable` (plain lists indexed by sample id), so engines,
the simulator and reports read the same numbers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from workers.coordinator.cost_model import CostModel
from workers.coordinator.state import InstanceSnapshot, RunningSample
from workers.rollout.engines.timing import BatchModel


class _LazyRunning(Sequence):
    """Per-running-sample details of a snapshot, built only if someone reads them (the
    migration strategy, rarely): the snapshot keeps the engine's (immutable) records, and the
    trajectories waiting for their environment (id -> (since, tokens, context, turn tokens)),
    listed after the decoding ones."""

    __slots__ = ("_items", "_it", "_vtraj", "_turn0", "_env", "_cache")

    def __init__(self, items: tuple, it: int, vtraj: list, turn0: list, env: tuple = ()):
        self._items: tuple | None = items
        self._it, self._vtraj, self._turn0, self._env = it, vtraj, turn0, env
        self._cache: tuple[RunningSample, ...] | None = None

    def _get(self) -> tuple[RunningSample, ...]:
        if self._cache is None:
            it, vt, t0 = self._it, self._vtraj, self._turn0
            cache = tuple(
                RunningSample(sid, r[2] + it, r[1] + it, vt[sid], r[2] + it - t0[sid]) for sid, r in self._items or ()
            ) + tuple(RunningSample(sid, g, c, vt[sid], tt, since) for sid, (since, g, c, tt) in self._env)
            self._cache, self._items = cache, None
            return cache
        return self._cache

    def __len__(self) -> int:
        return len(self._items or ()) + len(self._env) if self._cache is None else len(self._cache)

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
        # multi-turn (module docstring): `prompt` grows by each observation, `target` is the end
        # of the current turn
        self.plan: list[tuple | None] = [None]  # (turn tokens, observation tokens, env seconds)
        self.turn = [0]  # index of its current turn
        self.turn0 = [0]  # `gen` when its current turn started
        self.env_ready = [0.0]  # when its environment answers (0: not waiting for one)
        self.turn_end = [0.0]  # when its latest turn ended
        self.env_wait = [0.0]  # seconds it has waited for environments in all
        self.cache_at = [(0, -1, 0)]  # its context in a prefix cache: (instance, version, tokens)

    def add(self, sid: int, group: int, prompt: int, target: int, plan: tuple | None = None) -> None:
        if sid != len(self.group):
            raise ValueError(f"sample ids must be contiguous: got {sid}, expected {len(self.group)}")
        cols: tuple[tuple[list, Any], ...] = (
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
            (self.plan, plan),
            (self.turn, 0),
            (self.turn0, 0),
            (self.env_ready, 0.0),
            (self.turn_end, 0.0),
            (self.env_wait, 0.0),
            (self.cache_at, (0, -1, 0)),
        )
        for lst, v in cols:
            lst.append(v)

    def more_turns(self, sid: int) -> bool:
        plan = self.plan[sid]
        return plan is not None and self.turn[sid] < len(plan[0]) - 1

    def end_turn(self, sid: int, now: float, instance: int, version: int) -> float:
        """Its turn ended at `now` on `instance` (context cached there): when the environment answers."""
        plan = self.plan[sid]
        assert plan is not None
        self.turn_end[sid] = now
        self.env_ready[sid] = ready = now + plan[2][self.turn[sid]]
        self.cache_at[sid] = (instance, version, self.prompt[sid] + self.gen[sid])
        return ready

    def env_answer(self, sid: int) -> None:
        """The environment answered: its observation joins the context, the next turn starts."""
        plan = self.plan[sid]
        assert plan is not None
        t = self.turn[sid]
        self.env_wait[sid] += plan[2][t]
        self.prompt[sid] += plan[1][t]
        self.turn[sid] = t + 1
        self.turn0[sid] = self.gen[sid]
        self.target[sid] = self.gen[sid] + plan[0][t + 1]
        self.env_ready[sid] = 0.0


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
        self.turned = False  # a turn ended or an environment answered (the snapshot changed)
        # trajectories waiting for their environment between turns: sid -> answer time
        self.env: dict[int, float] = {}
        self._env_heap: list[tuple[float, int]] = []
        self._cached: set[int] = set()  # waiting samples whose context is in this engine's cache
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
        """Take samples off the engine with the tokens they have (trajectories waiting for
        their environment too); returns those it held."""
        sids = list(sids)
        out = self.batch.remove(sids)
        if self.env:
            out += [sid for sid in sids if self.env.pop(sid, None) is not None]
        for sid in out:
            self.table.instance[sid] = 0
            self._cached.discard(sid)
        return out

    def start_pull(self, now: float, version: int, duration: float) -> list[int]:
        """Interrupt everything, then load `version` for `duration` seconds."""
        out = self.interrupt(list(self.batch.run) + list(self.batch.waiting) + list(self.env), now)
        if self.t < now:
            # the iteration in flight is lost; the time since the last boundary was spent
            self.busy += now - self.t
            self.t = now
        self.stall_until = now
        self.pulling_until = now + duration
        self.pull_version = version
        return out

    # ---- the clock -------------------------------------------------------------------------

    def _next_answer(self) -> float:
        """When the next environment answers (inf: none pending)."""
        heap, env = self._env_heap, self.env
        while heap:
            ready, sid = heap[0]
            if env.get(sid) == ready:
                return ready
            heapq.heappop(heap)
        return math.inf

    def _answers(self) -> None:
        """Trajectories whose environment has answered by now rejoin the queue for their next turn."""
        heap, env, tbl = self._env_heap, self.env, self.table
        while heap and heap[0][0] <= self.t:
            ready, sid = heapq.heappop(heap)
            if env.get(sid) != ready:
                continue
            del env[sid]
            tbl.env_answer(sid)
            inst, ver, _ = tbl.cache_at[sid]
            if inst == self.id and ver == self.version:
                self._cached.add(sid)
            self.batch.waiting.append(sid)
            self.turned = True

    def _end_turns(self, done: list[int]) -> list[int]:
        """Of the samples whose target was reached, those that wait for their environment
        now; returns the ones that finished."""
        tbl, finished = self.table, []
        for sid in done:
            if tbl.more_turns(sid):
                ready = tbl.end_turn(sid, self.t, self.id, self.version)
                self.env[sid] = ready
                heapq.heappush(self._env_heap, (ready, sid))
                self.turned = True
            else:
                finished.append(sid)
        return finished

    def _admit(self) -> None:
        b = self.batch
        queue = list(b.waiting) if self._cached else None
        prefill = b.admit()
        if queue is not None:
            # admitted from the front: a turn whose context is still cached here prefills only
            # its observation (module docstring)
            attn, tbl = b.attn_coef, self.table
            for sid in queue[: len(queue) - len(b.waiting)]:
                if sid in self._cached:
                    self._cached.discard(sid)
                    c = tbl.cache_at[sid][2]
                    prefill -= c + attn * c * c
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
            if self.env:
                self._answers()
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
            answer = self._next_answer() if self.env else math.inf
            if n == 0:
                if answer <= T:  # idle until an environment answers
                    self.idle += answer - self.t
                    self.t = answer
                    continue
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
            stop = answer if answer < T else T  # an answer joins at the next iteration boundary
            budget = stop - self.t
            dt = b.time(k)
            partial = False
            if dt > budget:
                k = b.within(budget)
                if k <= 0:
                    if stop == T or b.time(1) > T - self.t:
                        return
                    k = 1  # the answer lands within this iteration
                dt = b.time(k)
                partial = stop == T
            self.t += dt
            self.busy += dt
            self.tokens += k * n
            done = b.decode(k)
            if done:
                plan = self.table.plan
                if any(plan[sid] is not None for sid in done):
                    done = self._end_turns(done)
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
        answer = self._next_answer() if self.env else math.inf
        if not b.run:
            return self.t if b.waiting else answer
        k = b.to_finish()
        k_kv = b.room()
        if k_kv < k:
            k = max(k_kv, 1)
        start = self.stall_until if self.stall_until > self.t else self.t
        t = start + b.time(k)
        return t if t < answer else max(answer, self.t)

    # ---- reporting -------------------------------------------------------------------------

    def segment_tokens(self, sid: int) -> int:
        return self.table.gen[sid] - self.table.seg0[sid]

    def snapshot(self, now: float, detail: bool = True) -> InstanceSnapshot:
        b = self.batch
        n = len(b.run)
        it = b.it
        samples: Sequence[RunningSample] = ()
        tbl = self.table
        if detail and (n or self.env):
            gen, ctx0 = tbl.gen, tbl.prompt
            env = tuple(
                (sid, (tbl.turn_end[sid], gen[sid], ctx0[sid] + gen[sid], gen[sid] - tbl.turn0[sid]))
                for sid in self.env
            )
            samples = _LazyRunning(tuple(b.run.items()), it, tbl.v_traj, tbl.turn0, env)
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
            env_waiting=len(self.env),
        )
