"""Coordinator policies compared in the discrete-event simulator (docs/coordinator.md, docs/policies.md).

    python bench/policies.py            # reference set-ups + workload shapes, η = 1, 2, 3, 32 steps
    python bench/policies.py --quick    # CI-sized: the small set-up, 10 steps
    python bench/policies.py --setups short_many,heavy_tail --out /tmp/pol   # some shapes
    python bench/policies.py --seeds 0,1,2 --reuse bench/results/policies.json   # rerun staleflow only

Set-ups: the four reference ones (qwen_14b, qwen_32b, qwen_moe_30b, qwen_7b) and the workload
shapes short_many, heavy_tail, correlated, few_instances, many_instances, balanced, agentic
(workers/sim/setups.py).
For each set-up and η: tokens/s and samples/s of every policy, the ratios staleflow/sync,
staleflow/one_step and staleflow/strict, the ratio to ideal, rollout idle fraction and the
staleness histogram; a per-shape staleflow/strict table; an ablation table (η = 2, reference
set-ups). Writes bench/results/policies.md, policies.json and PNG plots. Progress goes to
stdout; the LAST line printed is

    staleflow/sync=<avg> staleflow/strict=<avg> min_strict=<lowest>

(averages over the reference set-ups of the run, or over all of them when it has none; the
lowest staleflow/strict over every set-up and η).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.extras import require
from workers.sim.bench import BenchConfig, run_bench


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized run: the small set-up, 10 steps")
    ap.add_argument("--setups", help="comma-separated set-ups (default: the reference four and the workload shapes)")
    ap.add_argument("--steps", type=int, help="training steps per run (default 32)")
    ap.add_argument("--etas", help="comma-separated staleness bounds (default 1,2,3)")
    ap.add_argument("--jobs", type=int, help="parallel processes (default: min(2, CPUs))")
    ap.add_argument("--seeds", default="0", help="comma-separated workload seeds; figures are means over them")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument(
        "--reuse",
        help="a policies.json whose baseline runs (sync, one_step, strict) are taken instead of rerun "
        "when the same job (set-up, policy, η, steps, seed) is there",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    require("matplotlib")  # for the plots at the end, not after the runs
    cfg = BenchConfig.quick() if a.quick else BenchConfig()
    if a.setups:
        cfg.setups = tuple(s.strip() for s in a.setups.split(",") if s.strip())
    if a.steps:
        cfg.steps = a.steps
    if a.etas:
        cfg.etas = tuple(int(x) for x in a.etas.split(","))
        if cfg.ablation_eta not in cfg.etas:
            cfg.ablation_eta = cfg.etas[len(cfg.etas) // 2]
    if a.jobs:
        cfg.jobs = a.jobs
    cfg.seeds = tuple(int(x) for x in a.seeds.split(","))
    cfg.ablations = not a.no_ablations
    cfg.reuse = Path(a.reuse) if a.reuse else None
    _, line = run_bench(cfg, a.out, progress=lambda m: print(m, flush=True))
    print(line, flush=True)


if __name__ == "__main__":
    main()
