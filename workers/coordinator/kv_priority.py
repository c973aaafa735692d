"""KV priority for the oldest buffer: make room for a queued sample that gates it.

Where the KV caches bind (`few_instances`, `heavy_tail` at η ≥ 2: docs/policies.md, *What
binds*), the trainer waits for a buffer one of whose samples sits in the central queue
because no instance has KV room (or a slot) for it, while the instances decode samples of
newer buffers. `kv_priority_interrupts` then interrupts, on one instance, the newest-buffer
samples whose KV makes room for that sample; the next cycle's waterfall, which serves the
oldest level first, routes it into the room. The interrupted samples keep their tokens and
return to the queue behind it.

Pure function, like the strategies (see `strategies`): no I/O, no clock, inputs unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from .admission import Admission, AlwaysAdmit
from .routing import NEW_LEVEL, Levels
from .state import InstanceView, QueuedSample, RunningSample
from .strategies import InterruptDecision, oldest_running_version


def gating_sample(
    instances: Sequence[InstanceView], levels: Levels, exclude: frozenset[int] | set[int] = frozenset()
) -> tuple[int, QueuedSample] | None:
    """(level, sample): the first queued sample (not in `exclude`) of the oldest level in
    flight, when that level is at least as old as every running sample's V_traj — a sample
    the oldest unfinished buffer waits for. None when the oldest queued level is newer (the
    oldest buffer waits on decoding samples only) or only never-routed work is queued."""
    for level, samples in levels:
        if level == NEW_LEVEL:
            return None
        left = [s for s in samples if s.sample_id not in exclude]
        if not left:
            continue
        oldest = oldest_running_version(instances)
        if oldest is not None and oldest < level:
            return None
        return int(level), left[0]
    return None


def gating_level(instances: Sequence[InstanceView], levels: Levels) -> int | None:
    """The oldest queued level when the oldest unfinished buffer waits on it (`gating_sample`)."""
    found = gating_sample(instances, levels)
    return None if found is None else found[0]


def victims_for(i: InstanceView, level: int, need_kv: int) -> tuple[int, ...] | None:
    """The samples of `i` to interrupt so that one more sample of `need_kv` KV tokens fits
    (KV and a running slot): decoding samples of buffers newer than `level` only, newest
    buffer first, then the fewest tokens (the least prefill to redo). () when it fits
    already; None when those samples cannot make room."""
    kv, running = i.kv_used, i.running
    if kv + need_kv <= i.kv_capacity and running < i.max_running:
        return ()
    newer = sorted(
        (r for r in i.running_samples if r.v_traj > level and r.env_since is None),
        key=lambda r: (-r.v_traj, r.tokens, r.sample_id),
    )
    chosen: list[RunningSample] = []
    for r in newer:
        chosen.append(r)
        kv -= r.length
        running -= 1
        if kv + need_kv <= i.kv_capacity and running < i.max_running:
            return tuple(r.sample_id for r in chosen)
    return None


def kv_priority_interrupts(
    instances: Sequence[InstanceView],
    levels: Levels,
    admission: Admission | None = None,
    *,
    routed: frozenset[int] | set[int] = frozenset(),
) -> list[InterruptDecision]:
    """At most one interrupt a cycle (module docstring). `instances`: the views after this
    cycle's routes and pulls; `levels`: the queue levels (`queue_levels`), of which the
    samples in `routed` were routed this cycle.

    Nothing happens while some instance that may run the gating sample has room for it (the
    waterfall places it, or μ judged it not worth it there). Otherwise, of the instances that
    may run it (not pulling, no samples waiting in the engine, version at or above its latest
    segment's, reserve accepted), the one whose
    newer-buffer samples free the room at the least KV to recompute gives them up."""
    admission = admission or AlwaysAdmit()
    found = gating_sample(instances, levels, routed)
    if found is None:
        return []
    level, s = found
    best: tuple[int, int, tuple[int, ...]] | None = None
    for i in instances:
        if i.pulling or i.waiting > 0 or i.version < s.min_instance_version:
            continue  # the waterfall routes nothing to an engine with a queue of its own
        if not admission.admits(s, i.version):
            continue
        ids = victims_for(i, level, s.length)
        if ids == ():
            return []  # room already: routing's call
        if ids is None:
            continue
        lengths = {r.sample_id: r.length for r in i.running_samples}
        lost = sum(lengths[x] for x in ids)
        if best is None or (lost, i.instance_id) < best[:2]:
            best = (lost, i.instance_id, ids)
    if best is None:
        return []
    return [InterruptDecision(best[1], best[2], "kv_priority")]
