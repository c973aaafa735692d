"""Staleflow against strict on random workload shapes nobody tuned it on (docs/policies.md).

    python bench/random_shapes.py                      # shapes 0-63, η = 1, 2, 3, seed 0, 32 steps
    python bench/random_shapes.py --shapes 39,41 --seeds 0,1,2   # check some cells over 3 seeds
    python bench/random_shapes.py --quick              # CI-sized: 2 shapes, 8 steps

Each shape is a seeded draw of every knob of a set-up at once (workers/sim/shape_draws.py):
model, instances, batch, response and prompt lengths, within-group correlation, trainer size.
For each shape and η it runs `strict` and `staleflow` in the simulator on the same workload
and reports staleflow/strict (steady trained tokens/s; the mean over the seeds). Writes
bench/results/random_shapes.md and .json; progress goes to stdout. The LAST line printed is

    random_shapes cells=<n> below_strict=<cells under 1.00> min_strict=<lowest> mean_strict=<mean>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.sim.shape_draws import describe, random_setup
from workers.sim.simulator import simulate

POLICIES = ("strict", "staleflow")


def parse_shapes(text: str) -> list[int]:
    """`0-63` or `3,39,41` (or both: `0-7,39`)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return out


def run_one(job: tuple[int, str, int, int, int]) -> tuple[tuple[int, str, int, int, int], dict]:
    k, policy, eta, seed, steps = job
    r = simulate(random_setup(k), policy, eta=eta, steps=steps, seed=seed)
    return job, {
        "steady_tokens_per_s": r.steady_tokens_per_s,
        "ratio_to_ideal": r.ratio_to_ideal,
        "rollout_idle_fraction": r.rollout_idle_fraction,
        "rollout_pull_fraction": r.rollout_pull_fraction,
        "trainer_idle_fraction": r.trainer_idle_fraction,
        "regime_share": r.extra.get("regime_share", {}),
        "completed": r.completed,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0-63", help="shape indices: ranges and lists, e.g. 0-63 or 39,41")
    ap.add_argument("--etas", default="1,2,3")
    ap.add_argument("--cells", help="shape:η pairs instead of --shapes × --etas, e.g. 39:2,41:1")
    ap.add_argument("--seeds", default="0", help="workload seeds; a cell's ratio is the mean over them")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes")
    ap.add_argument("--quick", action="store_true", help="CI-sized: shapes 0-1, η = 1, 8 steps")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    try:
        shapes = [0, 1] if a.quick else parse_shapes(a.shapes)
        etas = (1,) if a.quick else tuple(int(x) for x in a.etas.split(","))
        seeds = tuple(int(x) for x in a.seeds.split(","))
        pairs = [(k, e) for k in shapes for e in etas]
        if a.cells:
            pairs = [(int(k), int(e)) for k, e in (c.split(":") for c in a.cells.split(","))]
            shapes = list(dict.fromkeys(k for k, _ in pairs))
            etas = tuple(sorted({e for _, e in pairs}))
    except ValueError:
        ap.error(
            "--shapes takes ranges and lists (0-63 or 39,41), --cells shape:η pairs (39:2,41:1), --etas and --seeds integers"
        )
    if min(shapes) < 0 or min(etas) < 1 or a.steps < 1:
        ap.error("shape indices must be >= 0, η >= 1 and --steps >= 1")
    steps = 8 if a.quick else a.steps
    jobs = [(k, p, e, s, steps) for k, e in pairs for s in seeds for p in POLICIES]
    print(f"{len(pairs)} cells (shape, η) × seeds {seeds} × {POLICIES}: {len(jobs)} runs of {steps} steps", flush=True)
    t0 = time.perf_counter()
    res: dict[tuple[int, str, int, int, int], dict] = {}
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        futs = [ex.submit(run_one, j) for j in jobs]
        for f in as_completed(futs):
            job, r = f.result()
            res[job] = r
            k, p, e, s, _ = job
            print(
                f"[{len(res)}/{len(jobs)} {time.perf_counter() - t0:5.0f}s] random_{k} {p:9s} η={e} seed={s}: "
                f"{r['steady_tokens_per_s']:9,.0f} tok/s",
                flush=True,
            )
    cells = []
    for k, e in pairs:
        per_seed = [
            res[(k, "staleflow", e, s, steps)]["steady_tokens_per_s"]
            / res[(k, "strict", e, s, steps)]["steady_tokens_per_s"]
            for s in seeds
        ]
        sf = res[(k, "staleflow", e, seeds[0], steps)]
        cells.append(
            {
                "shape": k,
                "eta": e,
                "ratio": statistics.mean(per_seed),
                "per_seed": per_seed,
                "staleflow_of_ideal": sf["ratio_to_ideal"],
                "regime": max(sf["regime_share"], key=sf["regime_share"].get) if sf["regime_share"] else "",
            }
        )
    below = [c for c in cells if c["ratio"] < 1.0]
    worst = min(cells, key=lambda c: c["ratio"])
    line = (
        f"random_shapes cells={len(cells)} below_strict={len(below)} min_strict={worst['ratio']:.2f} "
        f"mean_strict={statistics.mean(c['ratio'] for c in cells):.2f}"
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "random_shapes.json").write_text(
        json.dumps(
            {
                "steps": steps,
                "seeds": list(seeds),
                "cells": cells,
                "runs": [{"shape": j[0], "policy": j[1], "eta": j[2], "seed": j[3], **r} for j, r in res.items()],
            },
            indent=1,
        )
    )
    command = " ".join(["python bench/random_shapes.py", *(argv if argv is not None else sys.argv[1:])])
    (out / "random_shapes.md").write_text(
        markdown(cells, shapes, etas, seeds, steps, command, time.perf_counter() - t0, line)
    )
    print(f"wrote {out / 'random_shapes.md'} and .json", flush=True)
    print(line, flush=True)


def markdown(
    cells: list[dict],
    shapes: list[int],
    etas: tuple[int, ...],
    seeds: tuple[int, ...],
    steps: int,
    command: str,
    wall: float,
    line: str,
) -> str:
    by = {(c["shape"], c["eta"]): c for c in cells}
    lines = [
        "# Staleflow against strict on random workload shapes",
        "",
        f"`{command}`: {len(shapes)} shapes, {steps} steps, seeds {', '.join(map(str, seeds))}, "
        f"{wall / 60:.0f} minutes. Staleflow/strict, steady trained tokens/s (mean over the seeds; "
        "below 1.00 in bold); the staleflow run's regime estimate (seed "
        f"{seeds[0]}, the steady part's leading label).",
        "",
        "| shape | set-up | " + " | ".join(f"η = {e}" for e in etas) + " | regime |",
        "|---|---|" + "---|" * len(etas) + "---|",
    ]
    for k in shapes:
        ratios = []
        for e in etas:
            c = by.get((k, e))
            if c is None:
                ratios.append("")
                continue
            txt = f"{c['ratio']:.3f}"
            if len(seeds) > 1:
                txt += " (" + " ".join(f"{x:.2f}" for x in c["per_seed"]) + ")"
            ratios.append(f"**{txt}**" if c["ratio"] < 1.0 else txt)
        regimes = "/".join(by[(k, e)]["regime"] for e in etas if (k, e) in by)
        lines.append(f"| {k} | {describe(random_setup(k))} | " + " | ".join(ratios) + f" | {regimes} |")
    lines += ["", f"Last line: `{line}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
