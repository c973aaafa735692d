"""Policy comparison on the reference set-ups (docs/policies.md) (the engine of `bench/policies.py` and
`staleflow sim bench`).

For each set-up: `sync` (η = 0) and `one_step` (η = 1) once, `strict` and `staleflow` for
each η, and the ablations at one η. Every run of a set-up uses the same seed, so every policy
sees the same prompts and response lengths. Throughput is the steady-state trained tokens/s
(after the first fifth of the steps; the pipeline-fill of the first steps would otherwise
flatter or penalize policies depending on the run length), the whole-run figure is kept too.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from workers.coordinator.policies import ABLATIONS
from workers.extras import require

from .setups import PAPER_SETUPS, SHAPE_SETUPS, get_setup
from .simulator import SimResult, simulate


@dataclass(frozen=True)
class Job:
    setup: str
    policy: str
    eta: int
    steps: int
    seed: int


@dataclass
class BenchConfig:
    setups: tuple[str, ...] = PAPER_SETUPS + SHAPE_SETUPS
    etas: tuple[int, ...] = (1, 2, 3)
    # 32: a cell's ratio is within 1.4% of its 48-step value on average, 16 steps 3.1%
    # (docs/policies.md, "How close 16 steps come to the long run")
    steps: int = 32
    seeds: tuple[int, ...] = (0,)
    ablation_eta: int = 2
    ablations: bool = True
    jobs: int = field(default_factory=lambda: max(1, min(2, os.cpu_count() or 1)))
    # a policies.json whose runs of the baselines (every policy but staleflow and its
    # ablations) are taken instead of rerun when the same job is there: the baselines do not
    # depend on the strategy's code, and the simulator is deterministic per seed
    reuse: Path | None = None

    @classmethod
    def quick(cls) -> BenchConfig:
        """CI-sized: the small set-up, fewer steps."""
        return cls(setups=("small",), etas=(1, 2, 3), steps=10)

    @property
    def seed(self) -> int:
        return self.seeds[0]

    @property
    def reference_setups(self) -> tuple[str, ...]:
        """The set-ups the headline averages (and the ablations) cover: the reference four
        when the run includes any of them, otherwise every set-up of the run."""
        ref = tuple(s for s in self.setups if s in PAPER_SETUPS)
        return ref or self.setups


def plan_jobs(cfg: BenchConfig) -> list[Job]:
    jobs = []
    for s in cfg.setups:
        for seed in cfg.seeds:
            jobs.append(Job(s, "sync", 0, cfg.steps, seed))
            jobs.append(Job(s, "one_step", 1, cfg.steps, seed))
            for eta in cfg.etas:
                jobs.append(Job(s, "strict", eta, cfg.steps, seed))
                jobs.append(Job(s, "staleflow", eta, cfg.steps, seed))
            if cfg.ablations and s in cfg.reference_setups:
                for a in ABLATIONS:
                    jobs.append(Job(s, a, cfg.ablation_eta, cfg.steps, seed))
    # longest first, so the pool's last job is a short one
    weight = {"sync": 3, "one_step": 2, "strict": 2}
    return sorted(
        jobs, key=lambda j: -(weight.get(j.policy, 1) * get_setup(j.setup).batch_size * get_setup(j.setup).group_size)
    )


def _run(job: Job) -> SimResult:
    return simulate(job.setup, job.policy, eta=job.eta, steps=job.steps, seed=job.seed)


def run_jobs(jobs: list[Job], n_procs: int, progress: Callable[[str], None] | None = None) -> dict[Job, SimResult]:
    out: dict[Job, SimResult] = {}
    t0 = time.perf_counter()

    def note(job: Job, r: SimResult) -> None:
        if progress:
            progress(
                f"[{len(out)}/{len(jobs)} {time.perf_counter() - t0:5.0f}s] {job.setup:13s} {job.policy:23s} "
                f"eta={r.eta}: {r.steady_tokens_per_s:9,.0f} tok/s steady, {r.ratio_to_ideal:4.0%} of ideal, "
                f"idle {r.rollout_idle_fraction:4.0%}, {r.wall_time:5.1f}s wall"
            )

    if n_procs <= 1:
        for j in jobs:
            out[j] = _run(j)
            note(j, out[j])
        return out
    with ProcessPoolExecutor(max_workers=n_procs) as ex:
        futs = {ex.submit(_run, j): j for j in jobs}
        for f in as_completed(futs):
            j = futs[f]
            out[j] = f.result()
            note(j, out[j])
    return out


@dataclass
class Averaged:
    """A policy's results over the seeds of one cell (means; histograms and steps pooled)."""

    eta: int
    runs: int
    steady_tokens_per_s: float
    steady_samples_per_s: float
    tokens_per_s: float
    ratio_to_ideal: float
    rollout_idle_fraction: float
    rollout_pull_fraction: float
    staleness_hist: dict[int, int]
    step_times: list[float]
    commands: dict[str, float]
    coordinator_wall_s: float
    cycles: int
    per_seed_tokens_per_s: list[float]
    regime_share: dict[str, float] = field(default_factory=dict)  # the coordinator's estimate, steady part
    label_share: dict[str, float] = field(default_factory=dict)  # its per-cycle labels, steady part
    regime_switches: float = 0.0
    trainer_waits_on_queued: float = 0.0  # share of steady time the trainer waits on a queued sample's buffer


def average(results: dict[Job, SimResult]) -> dict[Job, Averaged]:
    groups: dict[Job, list[SimResult]] = {}
    for j, r in results.items():
        groups.setdefault(Job(j.setup, j.policy, j.eta, j.steps, -1), []).append(r)
    out = {}
    for j, rs in groups.items():
        mean = lambda f: statistics.mean(getattr(r, f) for r in rs)  # noqa: E731
        hist: dict[int, int] = {}
        cmds: dict[str, float] = {}
        for r in rs:
            for k, v in r.staleness_hist.items():
                hist[k] = hist.get(k, 0) + v
            for name, n in r.commands.items():
                cmds[name] = cmds.get(name, 0) + n / len(rs)
        shares: dict[str, float] = {}
        labels: dict[str, float] = {}
        for r in rs:
            for k, v in r.extra.get("regime_share", {}).items():
                shares[k] = shares.get(k, 0.0) + v / len(rs)
            for k, v in r.extra.get("label_share", {}).items():
                labels[k] = labels.get(k, 0.0) + v / len(rs)
        out[j] = Averaged(
            eta=rs[0].eta,
            runs=len(rs),
            steady_tokens_per_s=mean("steady_tokens_per_s"),
            steady_samples_per_s=mean("steady_samples_per_s"),
            tokens_per_s=mean("tokens_per_s"),
            ratio_to_ideal=mean("ratio_to_ideal"),
            rollout_idle_fraction=mean("rollout_idle_fraction"),
            rollout_pull_fraction=mean("rollout_pull_fraction"),
            staleness_hist=dict(sorted(hist.items())),
            step_times=[t for r in rs for t in r.step_times],
            commands=cmds,
            coordinator_wall_s=sum(r.coordinator_wall_s for r in rs),
            cycles=sum(r.cycles for r in rs),
            per_seed_tokens_per_s=[r.steady_tokens_per_s for r in rs],
            regime_share=dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            label_share=dict(sorted(labels.items(), key=lambda kv: -kv[1])),
            regime_switches=statistics.mean(r.extra.get("regime_switches", 0) for r in rs),
            trainer_waits_on_queued=statistics.mean(r.extra.get("trainer_waits_on_queued", 0.0) for r in rs),
        )
    return out


@dataclass
class Cell:
    setup: str
    eta: int
    sync: Averaged
    one_step: Averaged
    strict: Averaged
    staleflow: Averaged

    def ratio(self, other: Averaged) -> float:
        return (
            self.staleflow.steady_tokens_per_s / other.steady_tokens_per_s
            if other.steady_tokens_per_s
            else float("nan")
        )


def cells(results: dict[Job, Averaged], cfg: BenchConfig) -> list[Cell]:
    by = {(j.setup, j.policy, j.eta): r for j, r in results.items()}
    out = []
    for s in cfg.setups:
        for eta in cfg.etas:
            out.append(
                Cell(
                    s,
                    eta,
                    by[(s, "sync", 0)],
                    by[(s, "one_step", 1)],
                    by[(s, "strict", eta)],
                    by[(s, "staleflow", eta)],
                )
            )
    return out


def summary_line(cs: list[Cell], reference: tuple[str, ...]) -> str:
    """Averages over the reference set-ups' cells; min_strict over every cell of the run."""
    ref = [c for c in cs if c.setup in reference] or cs
    sync = statistics.mean(c.ratio(c.sync) for c in ref)
    strict = statistics.mean(c.ratio(c.strict) for c in ref)
    lowest = min(c.ratio(c.strict) for c in cs)
    return f"staleflow/sync={sync:.2f} staleflow/strict={strict:.2f} min_strict={lowest:.2f}"


def shape_table(cs: list[Cell], cfg: BenchConfig) -> list[str]:
    """One row per set-up: staleflow/strict at each η, the lowest, and whether it is a reference."""
    lines = [
        "| set-up | reference | " + " | ".join(f"staleflow/strict η={e}" for e in cfg.etas) + " | lowest |",
        "|---|---|" + "---|" * (len(cfg.etas) + 1),
    ]
    for s in cfg.setups:
        rs = [c.ratio(c.strict) for c in cs if c.setup == s]
        ref = "yes" if s in PAPER_SETUPS else "no"
        lines.append(f"| {s} | {ref} | " + " | ".join(f"{r:.2f}x" for r in rs) + f" | {min(rs):.2f}x |")
    return lines


def _hist(h: dict[int, int]) -> str:
    tot = sum(h.values()) or 1
    return " ".join(f"{k}:{v / tot:.0%}" for k, v in sorted(h.items()))


def markdown(results: dict[Job, Averaged], cfg: BenchConfig, wall: float, runs: int, reused: int = 0) -> str:
    cs = cells(results, cfg)
    lines = [
        "# Policy comparison (simulated)",
        "",
        f"`python bench/policies.py{' --quick' if cfg.setups == ('small',) else ''}` — {cfg.steps} training steps per run, "
        f"seeds {', '.join(map(str, cfg.seeds))} (figures are means over seeds; every policy of a seed sees the same "
        f"workload), set-ups {', '.join(cfg.setups)}; {runs} runs"
        + (f" ({reused} of them baselines taken from {cfg.reuse.name})" if reused and cfg.reuse else "")
        + f" in {wall:,.0f} s on this machine.",
        "Throughput = trained response tokens per second of simulated time, steady state (after the first fifth",
        "of the steps). Ideal = every rollout instance always at its peak T (KV cache full of average-context",
        "samples). Idle = rollout instance-time with nothing to decode. Staleness = share of trained groups by b − V_group.",
        "",
        "## StaleFlow against the baselines",
        "",
        "| set-up | η | sync tok/s | one_step tok/s | strict tok/s | staleflow tok/s | staleflow/sync | staleflow/one_step | staleflow/strict | staleflow of ideal | idle sync / strict / staleflow | staleflow staleness |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        lines.append(
            f"| {c.setup} | {c.eta} | {c.sync.steady_tokens_per_s:,.0f} | {c.one_step.steady_tokens_per_s:,.0f} | "
            f"{c.strict.steady_tokens_per_s:,.0f} | {c.staleflow.steady_tokens_per_s:,.0f} | "
            f"{c.ratio(c.sync):.2f}x | {c.ratio(c.one_step):.2f}x | {c.ratio(c.strict):.2f}x | "
            f"{c.staleflow.ratio_to_ideal:.0%} | {c.sync.rollout_idle_fraction:.0%} / {c.strict.rollout_idle_fraction:.0%} / "
            f"{c.staleflow.rollout_idle_fraction:.0%} | {_hist(c.staleflow.staleness_hist)} |"
        )
    best_strict = [
        c.staleflow.steady_tokens_per_s / max(c.strict.steady_tokens_per_s, c.one_step.steady_tokens_per_s)
        for c in cs
        if c.setup in cfg.reference_setups
    ]
    ref = [c for c in cs if c.setup in cfg.reference_setups]
    rs = [c.ratio(c.sync) for c in ref]
    rt = [c.ratio(c.strict) for c in ref]
    lines += [
        "",
        f"Averages over {', '.join(cfg.reference_setups)}:",
        "",
        f"- staleflow/sync: **{statistics.mean(rs):.2f}x average, {max(rs):.2f}x max** (reference: 1.91x average, up to 2.68x)",
        f"- staleflow/strict: **{statistics.mean(rt):.2f}x average, {max(rt):.2f}x max**; against the better of strict and "
        f"one_step per cell: {statistics.mean(best_strict):.2f}x average, {max(best_strict):.2f}x max (reference: 1.18x average, up to 1.42x)",
        f"- lowest staleflow/strict over every set-up and η: **{min(c.ratio(c.strict) for c in cs):.2f}x**",
        "",
        "## Per workload shape: staleflow/strict",
        "",
        *shape_table(cs, cfg),
        "",
        "## Samples/s, whole-run tokens/s and step times",
        "",
        "| set-up | policy | η | samples/s (steady) | tokens/s (whole run) | mean step s | p90 step s | of ideal | pull time | preemptions | migrations | coordinator ms/cycle |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j, r in sorted(results.items(), key=lambda kv: (kv[0].setup, kv[0].policy, kv[0].eta)):
        st = sorted(r.step_times)
        p90 = st[int(0.9 * (len(st) - 1))] if st else 0.0
        per_cycle = 1000 * r.coordinator_wall_s / r.cycles if r.cycles else 0.0
        lines.append(
            f"| {j.setup} | {j.policy} | {r.eta} | {r.steady_samples_per_s:.2f} | {r.tokens_per_s:,.0f} | "
            f"{statistics.mean(r.step_times):,.0f} | {p90:,.0f} | {r.ratio_to_ideal:.0%} | {r.rollout_pull_fraction:.1%} | "
            f"{r.commands.get('preemptions', 0):,.0f} | {r.commands.get('migration', 0):,.0f} | {per_cycle:.2f} |"
        )
    lines += [
        "",
        "## What binds staleflow (the coordinator's regime estimate, steady part)",
        "",
        "| set-up | η | regime estimate (share of time) | per-cycle labels | switches per run "
        "| trainer waits on a queued sample's buffer |",
        "|---|---|---|---|---|---|",
    ]
    for c in cs:
        sf = c.staleflow
        shares = " ".join(f"{k} {v:.0%}" for k, v in sf.regime_share.items() if v >= 0.005) or "-"
        labels = " ".join(f"{k} {v:.0%}" for k, v in sf.label_share.items() if v >= 0.005) or "-"
        lines.append(
            f"| {c.setup} | {c.eta} | {shares} | {labels} | {sf.regime_switches:.1f} "
            f"| {sf.trainer_waits_on_queued:.1%} |"
        )
    if cfg.ablations:
        lines += [
            "",
            f"## Ablations (η = {cfg.ablation_eta})",
            "",
            "| set-up | staleflow | naive routing | greedy pull | no migration |",
            "|---|---|---|---|---|",
        ]
        by = {(j.setup, j.policy, j.eta): r for j, r in results.items()}
        for s in cfg.reference_setups:
            base = by.get((s, "staleflow", cfg.ablation_eta))
            if base is None:
                continue
            row = [f"{base.steady_tokens_per_s:,.0f}"]
            for a in ABLATIONS:
                r = by[(s, a, cfg.ablation_eta)]
                row.append(f"{r.steady_tokens_per_s:,.0f} ({r.steady_tokens_per_s / base.steady_tokens_per_s:.2f}x)")
            lines.append(f"| {s} | " + " | ".join(row) + " |")
    if len(cfg.seeds) > 1:
        lines += ["", "## Per-seed staleflow/strict (spread)", "", "| set-up | η | per seed |", "|---|---|---|"]
        for c in cs:
            per = [a / b for a, b in zip(c.staleflow.per_seed_tokens_per_s, c.strict.per_seed_tokens_per_s)]
            lines.append(f"| {c.setup} | {c.eta} | " + " ".join(f"{x:.2f}" for x in per) + " |")
    lines += ["", summary_line(cs, cfg.reference_setups), ""]
    return "\n".join(lines)


def plots(results: dict[Job, Averaged], cfg: BenchConfig, out_dir: Path) -> list[Path]:
    matplotlib = require("matplotlib")  # the 'plots' extra, named when missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = cells(results, cfg)
    paths = []
    # 1. throughput per cell
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cs)), 4))
    names = ["sync", "one_step", "strict", "staleflow"]
    width = 0.2
    for k, name in enumerate(names):
        ys = [getattr(c, name).steady_tokens_per_s for c in cs]
        ax.bar([i + (k - 1.5) * width for i in range(len(cs))], ys, width, label=name)
    ax.set_xticks(range(len(cs)))
    ax.set_xticklabels([f"{c.setup}\nη={c.eta}" for c in cs], fontsize=8)
    ax.set_ylabel("trained tokens/s (steady)")
    ax.set_title("Throughput by policy (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "policies_throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    # 2. staleness histograms of staleflow
    fig, axes = plt.subplots(1, len(cfg.etas), figsize=(4 * len(cfg.etas), 3), squeeze=False)
    for ax, eta in zip(axes[0], cfg.etas):
        for s in cfg.setups:
            r = next(c.staleflow for c in cs if c.setup == s and c.eta == eta)
            tot = sum(r.staleness_hist.values()) or 1
            ks = list(range(eta + 1))
            ax.plot(ks, [r.staleness_hist.get(k, 0) / tot for k in ks], marker="o", label=s)
        ax.set_title(f"staleflow staleness, η={eta}")
        ax.set_xlabel("b − V_group")
        ax.set_xticks(list(range(eta + 1)))
    axes[0][0].set_ylabel("share of trained groups")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "policies_staleness.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    # 3. ablations
    if cfg.ablations:
        by = {(j.setup, j.policy, j.eta): r for j, r in results.items()}
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cfg.reference_setups)), 3.5))
        pols = ("staleflow",) + ABLATIONS
        for k, pol in enumerate(pols):
            ys = []
            for s in cfg.reference_setups:
                base = by[(s, "staleflow", cfg.ablation_eta)].steady_tokens_per_s
                ys.append(by[(s, pol, cfg.ablation_eta)].steady_tokens_per_s / base)
            ax.bar([i + (k - 1.5) * 0.2 for i in range(len(cfg.reference_setups))], ys, 0.2, label=pol)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(cfg.reference_setups)))
        ax.set_xticklabels(cfg.reference_setups, fontsize=8)
        ax.set_ylabel("tokens/s relative to staleflow")
        ax.set_title(f"Ablations (η={cfg.ablation_eta})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "policies_ablations.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _reused(path: Path, jobs: list[Job]) -> dict[Job, SimResult]:
    """The runs of `path` (a policies.json) for the baseline jobs among `jobs`."""
    wanted = {j for j in jobs if not j.policy.startswith("staleflow")}
    out = {}
    for e in json.loads(Path(path).read_text()):
        j = Job(**e["job"])
        if j in wanted:
            out[j] = SimResult.from_dict(e["result"])
    return out


def run_bench(
    cfg: BenchConfig, out_dir: str | Path, progress: Callable[[str], None] | None = print
) -> tuple[dict[Job, SimResult], str]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = plan_jobs(cfg)
    if progress:
        progress(
            f"{len(jobs)} simulations on {cfg.jobs} processes: set-ups {', '.join(cfg.setups)}, η {cfg.etas}, {cfg.steps} steps"
        )
    t0 = time.perf_counter()
    reused = _reused(cfg.reuse, jobs) if cfg.reuse else {}
    if reused and progress:
        progress(f"{len(reused)} baseline runs taken from {cfg.reuse}")
    results = {**reused, **run_jobs([j for j in jobs if j not in reused], cfg.jobs, progress)}
    wall = time.perf_counter() - t0
    avg = average(results)
    md = markdown(avg, cfg, wall, len(results), len(reused))
    (out_dir / "policies.md").write_text(md)
    raw = [{"job": j.__dict__, "result": r.to_dict()} for j, r in results.items()]
    (out_dir / "policies.json").write_text(json.dumps(raw, indent=1, default=str))
    paths = plots(avg, cfg, out_dir)
    if progress:
        progress(f"wrote {out_dir / 'policies.md'}, {out_dir / 'policies.json'}, " + ", ".join(str(p) for p in paths))
    return results, summary_line(cells(avg, cfg), cfg.reference_setups)
