"""How far the staleflow strategy's parameters can move staleflow/strict on the reference set-ups.

    python bench/policy_sweep.py [--seed 0] [--steps 32] [--jobs 2]

Runs `staleflow` under each of a set of one-parameter changes (routing μ, migration ψ and
gain, pull threshold and horizons, φ_wait, and the naive routing and pull rules) on every
reference set-up and η = 1, 2, 3, and divides each run's steady tokens/s by strict's on the
same seed and steps (run here: the diagnosis below runs strict anyway). Prints each cell's
ratio under every variant, each variant's mean, and the mean of the best variant chosen per
cell: an upper bound for parameter tuning that is optimistic, since it picks per cell on the
very runs it reports. Then, for the default staleflow and strict runs, what bounds them
(`diagnose`: KV fill, samples decoding against the staleness budget, time with budget left
unreserved, the coordinator's regime estimate and the time the trainer waits on a buffer with
a queued sample, and what its buffer's samples decode alongside while it waits). 156
simulations, about 30 minutes on 2 cores at 32 steps. The last line is

    sweep default=<mean> best_variant=<mean> per_cell_best=<mean>
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from workers.coordinator.policies import get_policy
from workers.sim.setups import PAPER_SETUPS
from workers.sim.simulator import Simulator, simulate

VARIANTS: list[dict] = [
    {},
    {"mu": 0.1},
    {"mu": 0.4},
    {"psi": 1.5},
    {"psi": 4.0},
    {"kv_threshold": 0.1},
    {"kv_threshold": 0.6},
    {"migrate_min_gain": 0.05},
    {"keep_horizon": 120.0},
    {"phi_wait": 4},
    {"routing": "request_count"},
    {"sync": "greedy"},
]
ETAS = (1, 2, 3)


def label(variant: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items()) or "default"


def one(job: tuple[str, int, int, int, int]) -> tuple[str, int, int, float]:
    setup, eta, k, seed, steps = job
    policy = get_policy("staleflow", **VARIANTS[k])
    return setup, eta, k, simulate(setup, policy, eta=eta, steps=steps, seed=seed).steady_tokens_per_s


def diagnose(job: tuple[str, str, int, int, int]) -> tuple[str, str, int, dict]:
    """A run's steady tokens/s and what bounds it, time-weighted over its steady part (after
    the first fifth of the virtual time): the rollout's KV fill, samples decoding against the
    samples the staleness budget lets into flight ((η+1)·B·N), the share of time that some
    group could still reserve a buffer at the PS's version (budget left unused), and, while
    the trainer waits for a buffer, that buffer's samples decoding, the samples running on
    their engines, and how much faster they would decode alone (an upper bound for any rule
    that keeps newer work off them)."""
    setup, policy, eta, seed, steps = job
    sim = Simulator(setup, policy, eta, seed)
    rec: list[tuple[float, ...]] = []

    def sample(*_: object) -> None:
        p, engines = sim.p, sim.engines.values()
        free = 0
        for b in range(p.version, p.version + sim.eta + 1):
            buf = p.buffers.get(b)
            if buf is None:
                free += p.limits.buffer_capacity
            elif not buf.consumed:
                free += max(0, p.limits.buffer_capacity - buf.occupied - buf.reserved)
        kv = sum(e.kv for e in engines) / sum(e.cap for e in engines)
        rec.append((sim.now, kv, sum(e.n for e in engines), float(free > 0), *trainer_waits_for()))

    def trainer_waits_for() -> tuple[float, float, float]:
        """While the trainer waits for the buffer of the run's version: the buffer's samples
        decoding, the samples running on their engines, and the factor by which their decode
        iterations would shorten if those engines ran nothing else, weighted per gating
        sample; (0, 0, 0) while it trains."""
        if sim.trainer.until is not None:
            return 0.0, 0.0, 0.0
        p, reserved, group = sim.p, sim.p.reserved, sim.table.group
        count, running, speedup = 0, 0.0, 0.0
        for e in sim.engines.values():
            gating = [
                sid
                for sid in e.batch.run
                if (g := reserved.get(group[sid])) is not None and g.reserved_buffer == p.version
            ]
            if gating:
                alone = e.cost.latency(len(gating), sum(e.batch.context(sid) for sid in gating))
                count += len(gating)
                running += e.n * len(gating)
                speedup += e.cost.latency(e.n, e.kv) / alone * len(gating)
        return float(count), running / max(count, 1), speedup / max(count, 1)

    sim.on_cycle = sample
    result = sim.run(steps)
    start = result.virtual_time * 0.2
    spans = [(t1 - t0, row) for (t0, *row), (t1, *_) in zip(rec, rec[1:], strict=False) if t0 >= start]
    total = sum(w for w, _ in spans) or 1.0
    kv, decoding, free = (sum(w * row[i] for w, row in spans) / total for i in range(3))
    waiting = [(w, row) for w, row in spans if row[3] > 0]  # the trainer waits, its buffer decodes
    wait_total = sum(w for w, _ in waiting) or 1.0
    gating, engine_n, speedup = (sum(w * row[i] for w, row in waiting) / wait_total for i in (3, 4, 5))
    budget = (sim.eta + 1) * sim.setup.batch_size * sim.setup.group_size
    regime = max(result.extra["regime_share"].items(), key=lambda kv: kv[1])
    return (
        setup,
        policy,
        eta,
        {
            "steady_tokens_per_s": result.steady_tokens_per_s,
            "kv_fill": kv,
            "decoding_share": decoding / budget,
            "budget_free": free,
            "regime": f"{regime[0]} {regime[1]:.0%}",
            "waits_on_queued": result.extra["trainer_waits_on_queued"],
            "gating_decoding": gating,
            "gating_engine_running": engine_n,
            "gating_speedup_alone": speedup,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    cells = [(s, e) for s in PAPER_SETUPS for e in ETAS]
    # The diagnosis runs the default staleflow and strict: their tokens/s are variant 0's and
    # the denominator, so those runs are not repeated below.
    diag_jobs = [(s, pol, e, args.seed, args.steps) for s, e in cells for pol in ("staleflow", "strict")]
    diag: dict[tuple[str, str, int], dict] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for n, (s, pol, e, d) in enumerate(pool.map(diagnose, diag_jobs), 1):
            diag[(s, pol, e)] = d
            print(f"[{n}/{len(diag_jobs)}] {s} η={e} {pol}: {d['steady_tokens_per_s']:,.0f} tok/s", flush=True)
    strict = {(s, e): diag[(s, "strict", e)]["steady_tokens_per_s"] for s, e in cells}
    ratio = {(s, e, 0): diag[(s, "staleflow", e)]["steady_tokens_per_s"] / strict[(s, e)] for s, e in cells}
    jobs = [(s, e, k, args.seed, args.steps) for s, e in cells for k in range(1, len(VARIANTS))]
    with ProcessPoolExecutor(args.jobs) as pool:
        for n, (s, e, k, tok) in enumerate(pool.map(one, jobs), 1):
            ratio[(s, e, k)] = tok / strict[(s, e)]
            print(f"[{n}/{len(jobs)}] {s} η={e} {label(VARIANTS[k])}: {ratio[(s, e, k)]:.3f}", flush=True)

    print("\n| set-up | η | default | best variant of the cell | its ratio |")
    print("|---|---|---|---|---|")
    best = []
    for s, e in cells:
        k = max(range(len(VARIANTS)), key=lambda i: ratio[(s, e, i)])
        best.append(ratio[(s, e, k)])
        print(f"| {s} | {e} | {ratio[(s, e, 0)]:.3f} | {label(VARIANTS[k])} | {ratio[(s, e, k)]:.3f} |")
    means = {k: sum(ratio[(s, e, k)] for s, e in cells) / len(cells) for k in range(len(VARIANTS))}
    print("\n| variant | mean staleflow/strict (reference set-ups, η = 1-3) |\n|---|---|")
    for k, m in sorted(means.items(), key=lambda x: -x[1]):
        print(f"| {label(VARIANTS[k])} | {m:.3f} |")
    print(
        "\n| set-up | η | KV fill staleflow / strict | decoding / budgeted samples | time with budget free "
        "| regime estimate staleflow / strict | trainer waits on a queued sample's buffer "
        "| while staleflow's trainer waits: its buffer's samples decoding, running on their engines, "
        "speed-up alone |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s, e in cells:
        a, b = diag[(s, "staleflow", e)], diag[(s, "strict", e)]
        print(
            f"| {s} | {e} | {a['kv_fill']:.0%} / {b['kv_fill']:.0%} | {a['decoding_share']:.0%} / "
            f"{b['decoding_share']:.0%} | {a['budget_free']:.0%} / {b['budget_free']:.0%} | "
            f"{a['regime']} / {b['regime']} | {a['waits_on_queued']:.1%} / {b['waits_on_queued']:.1%} | "
            f"{a['gating_decoding']:.0f}, {a['gating_engine_running']:.1f}, {a['gating_speedup_alone']:.2f}x |"
        )
    top = max(means.values())
    print(f"sweep default={means[0]:.3f} best_variant={top:.3f} per_cell_best={sum(best) / len(best):.3f}")


if __name__ == "__main__":
    main()
