"""A simulated rollout instance: continuous batching on the cost-model clock.

Decode iterations take `latency(n, kv)` (cost model); every running sample gains one token
per iteration, so KV grows by n per iteration. Between discrete events (a finish, the KV cache
filling up, the end of a prefill or a pull) nothing but that growth happens, so the engine
jumps straight to the next event in one arithmetic step:

    time of k iterations from (n, kv) = k·latency(n, kv) + attn_k·n·k(k-1)/2

Running samples are kept as *offsets* from the engine's iteration counter `it`: a sample
admitted at iteration it0 with g tokens finishes at `finish_it = it0 + (target - g)` and holds
`ctx = off_ctx + it` KV tokens, so advancing k iterations is `it += k` — O(1) whatever the
batch — and the next finish is the top of a heap.

Modelled: KV capacity (admission waits for room; when the cache is full the most recently
admitted sample is preempted back to the waiting queue and recomputed later, as vLLM does,
or — with φ_wait — interrupted back to the central queue), a max number of running
sequences, prefill time for every admission (context tokens / prefill rate; decoding
pauses meanwhile), interrupts (a sample leaves with the tokens it has) and pulls (interrupt
everything, load weights for `pull_time`, resume at the new version).

Sample data live in a shared `SampleTable` (plain lists indexed by sample id), so engines,
the simulator and reports read the same numbers.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from workers.coordinator.cost_model import CostModel
from workers.coordinator.state import InstanceSnapshot, RunningSample
from workers.coordinator.strategies import engine_should_interrupt_preempted


class _LazyRunning(Sequence):
    """Per-running-sample details of a snapshot, built only if someone reads them (the
    migration strategy, rarely): the snapshot keeps the engine's (immutable) records."""

    __slots__ = ("_items", "_it", "_vtraj", "_cache")

    def __init__(self, items: tuple, it: int, vtraj: list):
        self._items, self._it, self._vtraj, self._cache = items, it, vtraj, None

    def _get(self) -> tuple[RunningSample, ...]:
        if self._cache is None:
            it, vt = self._it, self._vtraj
            self._cache = tuple(RunningSample(sid, r[2] + it, r[1] + it, vt[sid]) for sid, r in self._items)
            self._items = None
        return self._cache

    def __len__(self) -> int:
        return len(self._items) if self._cache is None else len(self._cache)

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
        for lst, v in (
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
        ):
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
    ):
        self.id = iid
        self.cost = cost
        self.cap = int(kv_capacity)
        self.max_running = int(max_running)
        self.prefill_rate = float(prefill_rate)
        self.table = table
        self.version = version
        self.phi_wait = phi_wait
        # KV kept free at admission (vLLM's watermark): a sample is admitted only if the batch
        # can still decode afterwards, so admission and preemption never chase each other.
        self.watermark = max(self.cap // 100, self.max_running + 1)
        self._ab, self._ak = cost.attn_b, cost.attn_k
        self._thr, self._ob, self._ok = cost.other_threshold, cost.other_b, cost.other_k
        self.t = 0.0  # local clock: the end of the last whole iteration (or of the last state change)
        self.it = 0
        self.run: dict[int, list[int]] = {}  # sid -> [finish_it, off_ctx, off_gen]; admission order
        self.heap: list[tuple[int, int]] = []
        self.S = 0  # sum of off_ctx over running samples: kv = S + n·it
        self.waiting: deque[int] = deque()
        self.stall_until = 0.0
        self.pulling_until: float | None = None
        self.pull_version: int | None = None
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
        self.prefill_tokens = 0
        self.preemptions = 0
        self._hb_tokens = 0
        self._hb_t = 0.0

    # ---- cost helpers ----------------------------------------------------------------------

    def _lat(self, n: int, kv: int) -> float:
        o = self._ob + self._ok * n
        return self._ab + self._ak * kv + (o if o > self._thr else self._thr)

    def _time(self, n: int, kv: int, k: int) -> float:
        return k * self._lat(n, kv) + self._ak * n * k * (k - 1) * 0.5

    @property
    def n(self) -> int:
        return len(self.run)

    @property
    def kv(self) -> int:
        return self.S + len(self.run) * self.it

    @property
    def pulling(self) -> bool:
        return self.pulling_until is not None

    # ---- inputs ----------------------------------------------------------------------------

    def add(self, sid: int, now: float) -> None:
        """A routed sample arrives (it joins at the next iteration boundary)."""
        if not self.run and self.pulling_until is None and self.t < now:
            self.idle += now - self.t
            self.t = now
        self.waiting.append(sid)
        self.table.instance[sid] = self.id
        self.received += 1

    def _remove_running(self, sid: int) -> None:
        r = self.run.pop(sid)
        self.table.gen[sid] = r[2] + self.it
        self.S -= r[1]

    def interrupt(self, sids, now: float) -> list[int]:
        """Take samples off the engine with the tokens they have; returns those it held."""
        out = []
        drop = set()
        for sid in sids:
            if sid in self.run:
                self._remove_running(sid)
                out.append(sid)
            elif sid in self.waiting:
                drop.add(sid)
                out.append(sid)
        if drop:
            self.waiting = deque(s for s in self.waiting if s not in drop)
        for sid in out:
            self.table.instance[sid] = 0
        if not self.run:
            self.heap.clear()
        return out

    def start_pull(self, now: float, version: int, duration: float) -> list[int]:
        """Interrupt everything, then load `version` for `duration` seconds."""
        out = self.interrupt(list(self.run) + list(self.waiting), now)
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
        tbl = self.table
        run, heap = self.run, self.heap
        n = len(run)
        kv = self.S + n * self.it
        prefill = 0
        while self.waiting and n < self.max_running:
            sid = self.waiting[0]
            g = tbl.gen[sid]
            ctx = tbl.prompt[sid] + g
            if kv + ctx > self.cap - self.watermark and n > 0:
                break
            self.waiting.popleft()
            fi = self.it + (tbl.target[sid] - g)
            off_ctx = ctx - self.it
            run[sid] = [fi, off_ctx, g - self.it]
            self.S += off_ctx
            heapq.heappush(heap, (fi, sid))
            n += 1
            kv += ctx
            prefill += ctx
        if prefill:
            start = self.stall_until if self.stall_until > self.t else self.t
            self.stall_until = start + prefill / self.prefill_rate
            self.prefill_tokens += prefill

    def _preempt(self) -> None:
        sid = next(reversed(self.run))
        self._remove_running(sid)
        self.preemptions += 1
        if engine_should_interrupt_preempted(len(self.waiting) + 1, self.phi_wait):
            self.table.instance[sid] = 0
            self.interrupted.append(sid)
        else:
            self.waiting.appendleft(sid)

    def _finish_at_it(self) -> None:
        heap, run, it, tbl = self.heap, self.run, self.it, self.table
        while heap and heap[0][0] <= it:
            fi, sid = heapq.heappop(heap)
            r = run.get(sid)
            if r is None or r[0] != fi:
                continue
            del run[sid]
            self.S -= r[1]
            tbl.gen[sid] = tbl.target[sid]
            tbl.instance[sid] = 0
            self.finished.append(sid)

    def _top_finish(self) -> int:
        heap, run = self.heap, self.run
        while heap:
            fi, sid = heap[0]
            r = run.get(sid)
            if r is not None and r[0] == fi:
                return fi
            heapq.heappop(heap)
        raise RuntimeError("running samples but an empty finish heap")

    def advance(self, T: float) -> None:
        """Run the engine up to time T (it stops at the last iteration boundary <= T)."""
        while True:
            if self.pulling_until is not None:
                if self.pulling_until > T:
                    self.pull_total += T - self.t
                    self.t = T
                    return
                self.pull_total += self.pulling_until - self.t
                self.t = self.pulling_until
                self.version = self.pull_version
                self.pulling_until = self.pull_version = None
                self.pulled = True
            if self.waiting:
                self._admit()
            if self.stall_until > self.t:
                if self.stall_until >= T:
                    self.busy += T - self.t
                    self.t = T
                    return
                self.busy += self.stall_until - self.t
                self.t = self.stall_until
            n = len(self.run)
            if n == 0:
                if T > self.t:
                    self.idle += T - self.t
                    self.t = T
                return
            kv = self.S + n * self.it
            k_kv = (self.cap - kv) // n
            if k_kv <= 0:
                self._preempt()
                continue
            k_fin = self._top_finish() - self.it
            k = k_fin if k_fin < k_kv else k_kv
            budget = T - self.t
            dt = self._time(n, kv, k)
            partial = False
            if dt > budget:
                k = self.cost.iterations_within(n, kv, budget)
                if k <= 0:
                    return
                dt = self._time(n, kv, k)
                partial = True
            self.t += dt
            self.it += k
            self.busy += dt
            self.tokens += k * n
            if k == k_fin:
                self._finish_at_it()
            if partial:
                return

    def next_event_time(self) -> float:
        """When the next finish / preemption / pull end would happen with no new input."""
        if self.pulling_until is not None:
            return self.pulling_until
        n = len(self.run)
        if n == 0:
            return self.t if self.waiting else math.inf
        kv = self.S + n * self.it
        k = self._top_finish() - self.it
        k_kv = (self.cap - kv) // n
        if k_kv < k:
            k = max(k_kv, 1)
        start = self.stall_until if self.stall_until > self.t else self.t
        return start + self._time(n, kv, k)

    # ---- reporting -------------------------------------------------------------------------

    def segment_tokens(self, sid: int) -> int:
        return self.table.gen[sid] - self.table.seg0[sid]

    def snapshot(self, now: float, detail: bool = True) -> InstanceSnapshot:
        n = len(self.run)
        it = self.it
        tbl = self.table
        samples: Sequence[RunningSample] = ()
        if detail and n:
            samples = _LazyRunning(tuple(self.run.items()), it, tbl.v_traj)
        dt = now - self._hb_t
        thr = (self.tokens - self._hb_tokens) / dt if dt > 0 else 0.0
        self._hb_t, self._hb_tokens = now, self.tokens
        return InstanceSnapshot(
            instance_id=self.id,
            version=self.version,
            running=n,
            waiting=len(self.waiting),
            kv_used=self.S + n * it,
            kv_capacity=self.cap,
            running_samples=samples,
            throughput=thr,
            heartbeat_at=now,
            snapshot_at=now,
            pulling=self.pulling_until is not None,
            routed_seen=self.received,
            max_running=self.max_running,
        )
