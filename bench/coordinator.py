"""Coordinator cycle time at 10x the paper's scale (docs/coordinator.md, "Scale").

    python bench/coordinator.py            # qwen_14b_10x: 320 instances, B = 1280 x 16, 10,000 cycles
    python bench/coordinator.py --quick    # the paper's qwen_14b (32 instances), 40 cycles: seconds
    python bench/coordinator.py --profile  # also cProfile the slowest cycle's kind (top 25)

Drives the discrete-event simulator (`workers.sim`) with the `staleflow` policy: every cycle
is `run_cycle`, the function the live coordinator runs, on the simulator's speculative state
and queue. The first cycles route the fresh batches onto empty instances (up to 1280 samples
per cycle, the expensive case) until ~16k samples run; the rest is steady state (finishes
refilled, fresh groups arriving). Timed per cycle: the coordinator's own work in `run_cycle`
(planning, and feeding the applied commands back into the speculative state); the
simulator's side of `apply` (protocol, engines), which the database replaces in production,
is excluded. Cycle times are the CPU time of the coordinator's thread (`time.thread_time`): on
a dedicated core that is its wall time, and unlike wall time it does not count the waits for
a CPU on a shared machine (wall-time percentiles are printed too). The LAST line printed is

    coordinator instances=I in_flight=F p50_ms=A p99_ms=B max_ms=C

(F: the most samples running or waiting on instances at any measured cycle).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np

from workers.coordinator.cycle import CycleOutcome
from workers.sim.simulator import Simulator


class _Enough(Exception):
    """Raised from the cycle hook once enough cycles are measured (ends `Simulator.run`)."""


def measure(setup: str, cycles: int, *, eta: int = 1, seed: int = 0, profile: bool = False, progress=print) -> dict:
    times: list[float] = []  # CPU seconds
    walls: list[float] = []
    routes: list[int] = []
    kinds: list[tuple[int, int, int, int]] = []  # per cycle: routes, pulls, interrupted, step
    in_flight = 0
    prof = cProfile.Profile() if profile else None
    t_start = time.perf_counter()
    full_gc: list[float] = []  # CPU seconds of each full collection of the cyclic GC
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                gc_t0[0] = time.thread_time()
            else:
                full_gc.append(time.thread_time() - gc_t0[0])

    def on_cycle(out: CycleOutcome, wall: float, seconds: float) -> None:
        nonlocal in_flight
        times.append(seconds)
        walls.append(wall)
        routes.append(len(out.plan.routes))
        plan = out.plan
        kinds.append(
            (len(plan.routes), len(plan.pulls), sum(len(i.sample_ids) for i in plan.interrupts), sim.p.version)
        )
        in_flight = max(in_flight, sum(e.n + len(e.waiting) for e in sim.engines.values()))
        k = len(times)
        if k % 50 == 0 or seconds > 0.1:
            progress(
                f"cycle {k:4d} t={sim.now:7.1f}s virtual: {seconds * 1e3:7.1f} ms CPU "
                f"({wall * 1e3:7.1f} ms wall), "
                f"{len(out.plan.routes):4d} routes, {len(sim.queued):5d} queued, {in_flight:6d} in flight, "
                f"step {sim.p.version} "
                f"({time.perf_counter() - t_start:.0f}s wall)"
            )
        if k % 50 == 0:
            # the simulator's objects (every sample, the protocol model) are no part of a
            # coordinator: keep them out of the cyclic GC's full collections, whose pauses
            # grow with the heap and land in whichever cycle triggers one
            gc.freeze()
        if k >= cycles:
            raise _Enough

    sim = Simulator(setup, "staleflow", eta, seed, on_cycle=on_cycle)
    gc.freeze()
    gc.callbacks.append(on_gc)
    if prof is not None:
        prof.enable()
    try:
        sim.run(steps=1_000_000)
    except _Enough:
        pass
    finally:
        if prof is not None:
            prof.disable()
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
    if prof is not None:
        # the coordinator's functions only: the simulator's own are not what this measures
        stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative")
        stats.print_stats("coordinator", 25)
    ms = np.array(times) * 1e3
    wall_ms = np.array(walls) * 1e3
    fresh = ms[np.array(routes) >= 256] if routes else ms[:0]
    return {
        "setup": setup,
        "instances": len(sim.engines),
        "in_flight": in_flight,
        "cycles": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "wall_p50_ms": float(np.percentile(wall_ms, 50)),
        "wall_p99_ms": float(np.percentile(wall_ms, 99)),
        "wall_max_ms": float(wall_ms.max()),
        "slowest": [(k + 1, float(ms[k]), *kinds[k]) for k in np.argsort(-ms, kind="stable")[:5]],
        "full_gc": len(full_gc),
        "full_gc_max_ms": max(full_gc, default=0.0) * 1e3,
        "big_route_cycles": len(fresh),
        "big_route_max_ms": float(fresh.max()) if len(fresh) else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the paper's scale (qwen_14b), 40 cycles")
    ap.add_argument("--setup", help="a workers.sim set-up (default qwen_14b_10x)")
    ap.add_argument("--cycles", type=int, help="cycles to measure (default 10000; --quick 40)")
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the coordinator's functions")
    a = ap.parse_args(argv)
    setup = a.setup or ("qwen_14b" if a.quick else "qwen_14b_10x")
    cycles = a.cycles or (40 if a.quick else 10_000)
    print(f"{setup}: staleflow, eta={a.eta}, {cycles} cycles", flush=True)
    r = measure(setup, cycles, eta=a.eta, seed=a.seed, profile=a.profile, progress=lambda m: print(m, flush=True))
    print(
        f"{r['cycles']} cycles; {r['big_route_cycles']} routed >= 256 samples (max {r['big_route_max_ms']:.1f} ms CPU); "
        f"wall time p50 {r['wall_p50_ms']:.2f} ms, p99 {r['wall_p99_ms']:.2f} ms, max {r['wall_max_ms']:.2f} ms",
        flush=True,
    )
    for k, t, nr, npull, nint, step in r["slowest"]:
        print(
            f"slow: cycle {k} {t:.1f} ms CPU: {nr} routes, {npull} pulls, {nint} interrupted, step {step}", flush=True
        )
    print(f"full GC collections: {r['full_gc']}, longest {r['full_gc_max_ms']:.1f} ms CPU", flush=True)
    print(
        f"coordinator instances={r['instances']} in_flight={r['in_flight']} "
        f"p50_ms={r['p50_ms']:.2f} p99_ms={r['p99_ms']:.2f} max_ms={r['max_ms']:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
