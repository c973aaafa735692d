"""Process chaos: the real service as processes on a private embedded PostgreSQL — two API
replicas, a coordinator leader and standby, rollout workers, a reward worker, the torch trainer
and the parameter server (a tiny model) — while random processes of every role are SIGKILLed
and restarted as a supervisor would, and PostgreSQL itself is stopped (`pg_ctl stop -m fast`)
and SIGKILLed. Then the run drains to its target steps and is checked: steps contiguous, no
version trained twice, the PS's weights hash to the published checksum (every published
checksum equals the trainer's), the audit view empty, samples conserved exactly.

    python bench/chaos.py [--seconds 300] [--kills 24] [--drain-steps 3] [--rollouts 4]

A process that exits on its own is a failure (listed, then restarted so the run goes on).
The trainer is killed once between checkpoint and publish through its test hook
(STALEFLOW_TEST_PAUSE_AFTER_CHECKPOINT). Logs and `chaos.json` go to `reports/chaos-<time>/`.
Last line: `chaos kills=K db_restarts=R lost=L duplicated=D violations=V`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path and bench/api.py shadow the `api` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from api.auth import create_token
from bench.harness import PrivatePostgres, Role, Supervisor
from staleflow_cli.launch import free_port
from staleflow_db import migrate
from staleflow_db.db import make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.rollout.engines.sim_engine import encode_prompt
from workers.tasks.repeat import RepeatTask

console = Console(stderr=True, soft_wrap=True)  # one line per event, even in a log file
MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 4}
KINDS = ("api", "coordinator", "rollout", "reward", "trainer", "ps")
SIM_MAX_RESPONSE = 64


def prompts(args: argparse.Namespace, start: int, n: int) -> list[Prompt]:
    """Prompts start..start+n-1 of the run's data set (keys are stable, so a retried enqueue
    is idempotent)."""
    if args.engine == "sim":  # the sim engine reads each group's length distribution from its prompt
        return [Prompt(f"sim-{i}", encode_prompt(8, 8 + i % 24, 0.5)) for i in range(start, start + n)]
    made = RepeatTask().prompts(start + n, seed=args.seed, prefix="chaos")[start:]
    return [Prompt(k, t, m) for k, t, m in made]


def build(args: argparse.Namespace, report: Path, url: str, engine) -> tuple[Supervisor, int, dict[str, Any]]:
    task, sim = RepeatTask(), args.engine == "sim"
    p = Protocol(engine)
    run = p.create_run(
        f"chaos-{report.name}",
        RunConfig(
            batch_size=args.batch,
            group_size=args.group,
            eta=args.eta,
            dapo_filter=True,
            max_response_tokens=SIM_MAX_RESPONSE if sim else task.max_response,
            max_prompt_tokens=16,
        ),
    )
    p.enqueue(run, prompts(args, 0, args.prompts))
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward")}
    mc = json.dumps({"vocab_size": task.vocab_size, **MODEL, "max_seq": 8 + task.max_response, "eos_token_id": 0})
    apis = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    ps_addr = f"127.0.0.1:{free_port()}"
    sup = Supervisor(report, url, env={"STALEFLOW_HOME": str(report / "home")})
    try:
        launch(sup, args, run, sim, apis, ps_addr, tokens, mc, report)
    except BaseException:
        sup.__exit__(None, None, None)  # never leave half a service running
        raise
    return (
        sup,
        run,
        {
            "apis": apis,
            "ps": None if sim else ps_addr,
            "checkpoint": None if sim else str(report / "checkpoint"),
            "token": tokens["rollout"],  # reads the PS's weights back at the end
        },
    )


def launch(
    sup: Supervisor,
    args,
    run: int,
    sim: bool,
    apis: list[str],
    ps_addr: str,
    tokens: dict[str, str],
    mc: str,
    report: Path,
) -> None:
    for i, api in enumerate(apis):
        sup.launch(Role(f"api-{i}", "api", ["serve", "--port", api.rsplit(":", 1)[1], "--no-upgrade"]))
    if not sim:
        argv = ["ps", "--run", str(run), "--data-dir", str(report / "ps"), "--port", ps_addr.rsplit(":", 1)[1]]
        sup.launch(Role("ps", "ps", argv, env={"STALEFLOW_API_URL": apis[0], "STALEFLOW_TOKEN": tokens["trainer"]}))
    _wait_http(sup, apis)
    common = ["--run", str(run)]
    via = lambda i, role: {"STALEFLOW_API_URL": apis[i % 2], "STALEFLOW_TOKEN": tokens[role]}  # noqa: E731
    ck = report / "checkpoint"
    if sim:
        trainer = ["--sim", "--time-scale", "1", "--sim-overhead", "0.3", "--sim-s-per-token", "0"]
        rollout = ["--engine", "sim", "--time-scale", "0.1"]
    else:
        trainer = ["--ps", ps_addr, "--checkpoint-dir", str(ck), "--model-config", mc]
        rollout = ["--engine", "torch", "--ps", ps_addr, "--model-config", mc, "--kv-capacity", "2048"]
    sup.launch(
        Role(
            "trainer",
            "trainer",
            ["trainer", *common, *trainer, "--metrics-file", str(report / "trainer.jsonl")],
            via(0, "trainer"),
        )
    )
    sup.launch(
        Role(
            "reward",
            "reward",
            ["reward-worker", *common, "--verifier", "sim" if sim else "repeat", "--claim-seconds", "10"],
            via(1, "reward"),
        )
    )
    for i in range(args.rollouts):
        sup.launch(
            Role(
                f"rollout-{i}",
                "rollout",
                ["rollout-worker", *common, *rollout, "--phi-wait", "1", "--name", f"w{i}", "--heartbeat", "0.5"],
                via(i, "rollout"),
            )
        )
    for i in range(2):  # leader and standby: whichever holds the leader epoch leads
        sup.launch(Role(f"coordinator-{i}", "coordinator", ["coordinator", *common, "--lease", "3"]))


def _wait_http(sup: Supervisor, urls: list[str], timeout: float = 90) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                if httpx.get(f"{u}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{u} did not answer within {timeout}s")
            sup.reap()
            time.sleep(0.3)


def version(engine, run: int) -> int | None:
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT version FROM runs WHERE id = :r"), {"r": run}).scalar()
    except Exception:
        return None


class Chaos:
    def __init__(self, args, sup: Supervisor, pg: PrivatePostgres, engine, run: int, where: dict[str, Any]):
        self.args, self.sup, self.pg, self.engine, self.run, self.where = args, sup, pg, engine, run, where
        self.rng = random.Random(args.seed)
        self.db_restarts: list[str] = []
        self.events: list[str] = []
        self.last_v = 0
        self.fed = args.prompts  # prompts enqueued so far
        self.shown = time.monotonic()

    def log(self, msg: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    def tick(self) -> None:
        for name in self.sup.reap():
            self.log(f"[red]{name} exited on its own[/red] (restarted)")
        v = version(self.engine, self.run)
        if v is not None:
            self.last_v = v
            self.feed()
        if time.monotonic() - self.shown > 10:
            self.shown = time.monotonic()
            console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {self.progress()}")

    def feed(self) -> None:
        """Keep prompts queued, as a data loader would: the run must never stall for want of
        work, however fast it trains between kills."""
        try:
            with self.engine.connect() as c:
                queued = c.execute(
                    text("SELECT count(*) FROM prompt_groups WHERE run_id = :r AND state = 'queued'"), {"r": self.run}
                ).scalar()
            if queued < self.args.batch * (self.args.eta + 2):
                n = self.args.batch * 8
                Protocol(self.engine).enqueue(self.run, prompts(self.args, self.fed, n))
                self.fed += n
        except Exception:
            pass

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def progress(self) -> str:
        r = self.sup.record
        return (
            f"version {self.last_v}, kills {sum(r.kills.values())}, restarts {r.restarts}, "
            f"db restarts {len(self.db_restarts)}, exited on their own {len(r.exited)}"
        )

    def kill_random(self, kind: str) -> None:
        names = [n for n, role in self.sup.roles.items() if role.kind == kind]
        name = self.rng.choice(names)
        self.sup.kill(name)
        self.log(f"SIGKILL {name}; {self.progress()}")

    def kill_trainer_after_checkpoint(self, timeout: float = 120) -> bool:
        """Restart the trainer with the pause hook, wait until it checkpointed a version it has
        not pushed or published yet, and SIGKILL it there."""
        role = self.sup.roles["trainer"]
        v = version(self.engine, self.run) or 0
        target = v + 2  # a step it will surely train after resuming
        role.env["STALEFLOW_TEST_PAUSE_AFTER_CHECKPOINT"] = str(target)
        self.sup.kill("trainer")
        flag = Path(self.where["checkpoint"]) / f"paused-v{target}"
        end = time.monotonic() + timeout
        while not flag.exists() and time.monotonic() < end:
            self.tick()
            time.sleep(0.3)
        role.env.pop("STALEFLOW_TEST_PAUSE_AFTER_CHECKPOINT")
        hit = flag.exists()
        self.sup.kill("trainer")  # restarts without the hook: it must publish v{target} exactly once
        self.sup.record.kills["trainer"] -= 1  # the first kill only armed the hook
        self.sup.record.kills["trainer (checkpoint->publish)"] = int(hit)
        self.log(f"SIGKILL trainer {f'between checkpoint and publish of v{target}' if hit else '(hook not reached)'}")
        return hit

    def db_outage(self, how: str) -> None:
        if how == "fast":
            self.log("PostgreSQL: pg_ctl stop -m fast")
            self.pg.stop_fast()
        else:
            pid = self.pg.kill_postmaster()
            self.log(f"PostgreSQL: SIGKILL postmaster {pid}")
        self.sleep(self.args.outage)
        self.pg.start()
        self.db_restarts.append(how)
        self.engine.dispose()
        self.log(f"PostgreSQL back; {self.progress()}")

    def run_chaos(self) -> None:
        a = self.args
        kinds = [k for k in KINDS if k in {r.kind for r in self.sup.roles.values()}]
        plan = [k for k in kinds for _ in range(max(1, a.kills // len(kinds)))]
        plan += [self.rng.choice(kinds) for _ in range(a.kills - len(plan))]
        self.rng.shuffle(plan)
        if self.where["checkpoint"]:  # the torch trainer checkpoints: hit the window before publish
            plan.insert(len(plan) // 2, "trainer-window")
        steps = len(plan) + 2
        outages = {steps // 3: "fast", (2 * steps) // 3: "kill"}
        interval = a.seconds / steps
        started = time.monotonic()
        for i in range(steps):
            self.sleep(max(0.0, started + (i + 1) * interval - time.monotonic()) * self.rng.uniform(0.5, 1.0))
            if i in outages:
                self.db_outage(outages.pop(i))
            if plan:
                kind = plan.pop(0)
                self.kill_trainer_after_checkpoint() if kind == "trainer-window" else self.kill_random(kind)
        for how in outages.values():
            self.db_outage(how)

    def drain(self) -> int:
        target = self.last_v + self.args.drain_steps
        self.log(f"draining: no more kills; waiting for version {target}")
        end = time.monotonic() + self.args.drain_timeout
        while self.last_v < target and time.monotonic() < end:
            self.sleep(1.0)
        return target


def check(engine, run: int, where: dict[str, Any]) -> dict[str, Any]:
    """Everything the run must satisfy after the chaos, from SQL, the trainer's log and the PS."""

    def q(sql: str) -> list:
        with engine.connect() as c:
            return c.execute(text(sql), {"r": run}).all()

    v = q("SELECT version FROM runs WHERE id = :r")[0][0]
    consumed = [b for (b,) in q("SELECT idx FROM buffers WHERE run_id = :r AND consumed_at IS NOT NULL ORDER BY idx")]
    published = dict(q("SELECT version, checksum FROM param_versions WHERE run_id = :r"))
    log = []
    if where["checkpoint"]:
        from workers.trainer.torch_trainer import read_steps_log  # torch

        log = read_steps_log(Path(where["checkpoint"]))
    trained = Counter(e["buffer"] for e in log if e["event"] == "trained")
    trained_sum = {e["version"]: e["checksum"] for e in log if e["event"] == "trained"}
    acked = {e["version"] for e in log if e["event"] == "published"}
    problems = []
    if consumed != list(range(v)) or sorted(published) != list(range(1, v + 1)):
        problems.append(f"steps not contiguous: consumed {consumed}, published {sorted(published)}, version {v}")
    twice = sorted(b for b, n in trained.items() if n > 1)
    problems += [f"buffer {b} trained {trained[b]} times" for b in twice]
    missing = sorted(x for x in acked if x not in published)
    problems += [f"the trainer saw v{x} published but the database lacks it" for x in missing]
    wrong = sorted(x for x in published if trained_sum.get(x) not in (None, published[x]))
    problems += [f"v{x}: published checksum {published[x][:12]} != trained {trained_sum[x][:12]}" for x in wrong]
    ps_version = ps_sum = None
    if where["ps"]:  # read the weights back and hash them as the trainer does
        from workers.client import StaleFlowClient
        from workers.trainer.param_auth import PSCredentials
        from workers.trainer.param_client import ParamClient
        from workers.trainer.param_store import state_dict_checksum

        with StaleFlowClient(where["apis"], where["token"]) as api:
            creds = PSCredentials.fetch(api, run, "rollout")
        sd, ps_version, _ = ParamClient(where["ps"], timeout_s=60, credentials=creds).pull()
        ps_sum = state_dict_checksum(sd)
        if ps_version != v or ps_sum != published.get(v):
            problems.append(
                f"PS serves v{ps_version} ({ps_sum[:12]}), the run is at v{v} ({str(published.get(v))[:12]})"
            )
    classes = dict(
        q(
            "SELECT CASE WHEN s.state = 'aborted' THEN 'dropped: ' || coalesce(s.reason, 'NO REASON')"
            " WHEN s.state = 'rewarded' AND g.state = 'consumed' THEN 'trained'"
            " WHEN g.state IN ('queued', 'reserved', 'occupied') THEN 'in flight'"
            " ELSE 'unaccounted: sample ' || s.state || ' in group ' || g.state END, count(*)"
            " FROM samples s JOIN prompt_groups g ON g.id = s.group_id WHERE s.run_id = :r GROUP BY 1"
        )
    )
    created = q("SELECT count(*) FROM samples WHERE run_id = :r")[0][0]
    unaccounted = sum(n for k, n in classes.items() if k.startswith("unaccounted") or k.endswith("NO REASON"))
    problems += [
        f"{n} samples {k}" for k, n in classes.items() if k.startswith("unaccounted") or k.endswith("NO REASON")
    ]
    dup_trained = q("SELECT count(*) - count(DISTINCT sample_id) FROM trained_samples WHERE run_id = :r")[0][0]
    violations = [list(r) for r in q("SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r")]
    problems += [f"violation {r}" for r in violations]
    return {
        "version": v,
        "created": created,
        "classes": classes,
        "violations": violations,
        "lost": unaccounted + len(missing) + (created - sum(classes.values())),
        "duplicated": len(twice) + dup_trained,
        "ps": {"version": ps_version, "checksum": ps_sum},
        "problems": problems,
    }


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"chaos run {result['run_id']} ({result['seconds']:.0f} s)")
    t.add_column("what")
    t.add_column("figure", justify="right")
    for kind, n in sorted(result["kills"].items()):
        t.add_row(f"kills: {kind}", str(n))
    t.add_row("restarts by the supervisor", str(result["restarts"]))
    t.add_row(
        "exited on their own",
        str(len(result["exited"])) + "".join(f"\n  {n} (rc {rc})" for n, rc, _ in result["exited"]),
    )
    t.add_row("database restarts", ", ".join(result["db_restarts"]) or "0")
    c = result["check"]
    t.add_row("version reached", str(c["version"]))
    t.add_row("samples created", str(c["created"]))
    for k, n in sorted(c["classes"].items()):
        t.add_row(f"samples {k}", str(n))
    t.add_row("lost / duplicated", f"{c['lost']} / {c['duplicated']}")
    t.add_row("staleness_violations", str(len(c["violations"])))
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300, help="length of the chaos phase")
    ap.add_argument("--kills", type=int, default=24, help="SIGKILLs of service processes (at least one per role)")
    ap.add_argument("--drain-steps", type=int, default=3, help="steps to train after the chaos")
    ap.add_argument("--drain-timeout", type=float, default=240)
    ap.add_argument("--outage", type=float, default=4.0, help="seconds PostgreSQL stays down each time")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument(
        "--engine",
        choices=("torch", "sim"),
        default="torch",
        help="torch: tiny model, torch trainer and PS; sim: cost-model engines, sim trainer, no PS",
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-dir", type=Path, default=Path("reports"))
    args = ap.parse_args(argv)
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: the service processes and the server are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = (args.report_dir / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    report.mkdir(parents=True)
    pg = PrivatePostgres(report / "home")
    url = pg.start()
    migrate.upgrade(url)
    engine = make_engine(url, pool_size=2, max_overflow=2)
    started = time.monotonic()
    chaos = None
    try:
        sup, run, where = build(args, report, url, engine)
        with sup:
            chaos = Chaos(args, sup, pg, engine, run, where)
            console.print(f"[bold]chaos run {run}[/bold]: logs in {report / 'logs'}; waiting for the first step")
            end = time.monotonic() + 180
            while chaos.last_v < 1 and time.monotonic() < end:
                chaos.sleep(1.0)
            chaos.run_chaos()
            chaos.drain()
            sup.stop("trainer")  # no push may race the PS check
            sup.reap(restart_exited=False)
            result_check = check(engine, run, where)
    finally:
        engine.dispose()
        pg.stop_fast()
    rec = sup.record
    result = {
        "run_id": run,
        "seconds": time.monotonic() - started,
        "kills": rec.kills,
        "restarts": rec.restarts,
        "exited": rec.exited,
        "db_restarts": chaos.db_restarts,
        "events": chaos.events,
        "check": result_check,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (report / "chaos.json").write_text(json.dumps(result, indent=2))
    Console().print(table(result))
    for pr in result_check["problems"]:
        print("PROBLEM", pr)
    for name, rc, tail in rec.exited:
        print(f"EXITED {name} rc={rc}; log ends:\n{tail}\n")
    print(f"report: {report}")
    kills = sum(n for k, n in rec.kills.items() if "->" not in k)
    print(
        f"chaos kills={kills} db_restarts={len(chaos.db_restarts)} lost={result_check['lost']} "
        f"duplicated={result_check['duplicated']} violations={len(result_check['violations'])}"
    )
    bad = result_check["problems"] or rec.exited
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
