"""Backend kills: protocol operations from several processes while another process kills their
PostgreSQL backends at random moments (idle, mid-transaction, at commit), then a check that
the database agrees with what every caller was told.

The worker and killer processes, and the journal each call leaves (`acked`, `refused` or
`unknown`), live in bench/backend_kills_workers.py; this file sets up the run, drives the
processes and checks their journals against the database.

    python bench/backend_kills.py [--seconds 120] [--ops 0] [--workers 3] [--nodes 1]

Rollout workers make each instance's calls apart; a node worker hosts several instances and
makes their calls together (node sync and node poll, bench/backend_kills_workers.py).

The test `tests/db/test_backend_kills.py` runs the CI-sized configuration. Last line:
`backend_kills kills=K ops=N unknown=U problems=P violations=V`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path and bench/api.py shadow the `api` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

from sqlalchemy import text

from bench.backend_kills_workers import expected, killer_main, worker_main
from staleflow_db.db import make_engine
from staleflow_db.payloads import unpack_tokens
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig

SPAWN = mp.get_context("spawn")
CONFIG = dict(
    batch_size=4,
    buffer_capacity=5,
    group_size=2,
    samples_per_group=3,
    eta=2,
    dapo_filter=True,
    max_response_tokens=40,
    max_prompt_tokens=8,
)


def setup_run(engine, prompts: int) -> int:
    p = Protocol(engine)
    run = p.create_run(f"backend-kills-{uuid.uuid4().hex[:6]}", RunConfig(**CONFIG))
    p.enqueue(run, [Prompt(f"q{i}", [1 + i % 7, 2, 3]) for i in range(prompts)])
    return run


def drive(
    url: str, run: int, out_dir: Path, seconds: float, rollouts: int = 3, ops: int = 0, nodes: int = 1
) -> dict[str, Any]:
    """Run the workers and the killer; returns the journals by worker name (plus `killer`)."""
    roles = [("rollout", f"rollout-{i}") for i in range(rollouts)]
    roles += [("node", f"node-{i}") for i in range(nodes)]
    roles += [("reward", "reward-0"), ("trainer", "trainer"), ("meddler", "meddler")]
    procs = [
        SPAWN.Process(target=worker_main, args=(kind, url, run, name, str(out_dir), seconds, ops, seed))
        for seed, (kind, name) in enumerate(roles)
    ]
    procs.append(SPAWN.Process(target=killer_main, args=(url, str(out_dir), seconds, 99)))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(seconds + 60)
        if proc.is_alive():
            proc.kill()
    return {f.stem: json.loads(f.read_text()) for f in out_dir.glob("*.json")}


def _rows(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).all()


def check(engine, run: int, logs: dict[str, Any]) -> dict[str, Any]:
    """Every acked outcome in the database, every refused one absent, unknown ones all-or-nothing;
    segments never duplicated; the audit view empty. Returns figures and a list of problems."""
    problems: list[str] = []
    calls = [c for name, log in logs.items() if name != "killer" for c in log["calls"]]
    problems += [f"{n}: crashed\n{log['crash']}" for n, log in logs.items() if log.get("crash")]
    problems += [
        f"{c['worker']} {c['op']}: unexpected database error {c['error']}\n{c.get('traceback', '')}"
        for c in calls
        if c.get("outcome") == "failed"
    ]
    problems += [
        f"sample {c['sample']}: delivered prefix differs from the reported tokens"
        for c in calls
        if c.get("outcome") == "mismatch"
    ]
    segs = defaultdict(list)
    for sid, _seq, att, toks in _rows(
        engine,
        "SELECT sample_id, seq, attempt, token_ids FROM segments WHERE run_id = :r ORDER BY sample_id, seq",
        r=run,
    ):
        segs[sid].append((att, tuple(unpack_tokens(toks))))
    have = lambda sid, att, toks: (att, tuple(toks)) in segs.get(sid, [])  # noqa: E731

    def present(c: dict) -> list[bool]:
        return [have(*i) for i in c["items"] if i[2]]

    rewards = {
        sid: (att, r)
        for sid, att, r in _rows(engine, "SELECT id, reward_attempt, reward FROM samples WHERE run_id = :r", r=run)
    }
    stored = lambda sid, att, val: rewards.get(sid) == (att, val)  # noqa: E731
    acked_items = {
        (c["op"], *map(_key, i)) for c in calls if c.get("outcome") == "acked" and "items" in c for i in c["items"]
    }
    unknown_rids = {c["request_id"] for c in calls if c.get("outcome") == "unknown" and "request_id" in c}
    known_rids = {c["request_id"] for c in calls if c.get("outcome") in ("acked", "refused") and "request_id" in c}
    for c in calls:
        op, outcome = c["op"], c.get("outcome")
        if op == "report":
            got = present(c)
            if outcome == "acked" and not all(got):
                problems.append(f"acked report missing: {c['items']} ({c['worker']} #{c['n']})")
            if outcome == "refused" and any(got) and (op, *map(_key, c["items"][0])) not in acked_items:
                problems.append(_refused_applied(c, unknown_rids))
        elif op == "node_sync" and outcome == "unknown" and c["request_id"] not in known_rids:
            # never told: each instance's item applied whole or not at all
            for iid, part in c["parts"].items():
                got = {have(*seg) for seg in part if seg[2]}
                if len(got) > 1:
                    problems.append(f"node sync item of instance {iid} half applied: {part} ({c['worker']} #{c['n']})")
        elif op == "reward":
            got = [stored(*i) for i in c["items"]]
            if outcome == "acked" and not all(got):
                problems.append(f"acked rewards missing: {[i for i, g in zip(c['items'], got) if not g]}")
            if (
                outcome == "unknown"
                and len(set(got)) > 1
                and not any((op, *map(_key, i)) in acked_items for i in c["items"])
            ):
                problems.append(f"reward call half applied: {c['items']}")
            if outcome == "refused":
                lost = set(c.get("lost", []))
                if any(i[0] in lost and stored(*i) for i in c["items"]):
                    problems.append(_refused_applied(c, unknown_rids))
    published = dict(_rows(engine, "SELECT version, checksum FROM param_versions WHERE run_id = :r", r=run))
    ours = defaultdict(set)  # version -> checksums of the calls that may have published it
    for c in calls:
        if c["op"] == "publish" and c.get("outcome") in ("acked", "unknown"):
            ours[c["version"] + 1].add(c["checksum"])
    for c in calls:
        if c["op"] != "publish":
            continue
        v1 = c["version"] + 1
        if c.get("outcome") == "acked" and published.get(v1) not in ours[v1]:
            problems.append(f"acked publish of v{v1} missing or foreign: {published.get(v1)!r}")
        if c.get("outcome") == "refused" and published.get(v1) == c["checksum"]:
            problems.append(f"refused publish of v{v1} applied")
    states = dict(_rows(engine, "SELECT id, state::text FROM samples WHERE run_id = :r", r=run))
    groups = dict(_rows(engine, "SELECT id, state::text FROM prompt_groups WHERE run_id = :r", r=run))
    problems += [
        f"acked abort of group {c['aborted_group']} not applied ({groups.get(c['aborted_group'])})"
        for c in calls
        if c.get("aborted_group") and groups.get(c["aborted_group"]) != "aborted"
    ]
    for c in calls:
        if c["op"] == "abort" and c.get("outcome") == "acked":
            problems += [
                f"acked abort of sample {s} not applied ({states.get(s)})"
                for s in c["aborted"]
                if states.get(s) != "aborted"
            ]
        if c["op"] == "route" and c.get("outcome") == "acked":
            attempts = dict(
                _rows(
                    engine,
                    "SELECT id, attempt FROM samples WHERE id = ANY(:ids)",
                    ids=[s for s, _ in c["routed"]] or [0],
                )
            )
            problems += [
                f"acked route of sample {s} attempt {a} not stored" for s, a in c["routed"] if attempts.get(s, 0) < a
            ]
    for sid, parts in segs.items():
        toks = [t for _, seg in parts for t in seg]
        if toks != expected(sid, len(toks)):
            problems.append(
                f"sample {sid}: tokens are not the concatenation of one generation "
                f"(duplicated or lost segment): {[len(s) for _, s in parts]}"
            )
    n_tok = dict(_rows(engine, "SELECT id, n_tokens FROM samples WHERE run_id = :r", r=run))
    problems += [
        f"sample {s}: n_tokens {n_tok[s]} != segments {sum(len(x) for _, x in segs.get(s, []))}"
        for s in n_tok
        if n_tok[s] != sum(len(x) for _, x in segs.get(s, []))
    ]
    version = _rows(engine, "SELECT version FROM runs WHERE id = :r", r=run)[0][0]
    if sorted(published) != list(range(1, version + 1)):
        problems.append(f"published versions {sorted(published)} not contiguous up to {version}")
    violations = _rows(engine, "SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r", r=run)
    problems += [f"violation {v}" for v in violations]
    outcomes, node_syncs = defaultdict(int), defaultdict(int)
    for c in calls:
        outcomes[c.get("outcome", "?")] += 1
        if c["op"] == "node_sync":
            node_syncs[c.get("outcome", "?")] += 1
    kills = logs.get("killer", {}).get("kills", {})
    return {
        "version": version,
        "kills": kills,
        "outcomes": dict(outcomes),
        "calls": len(calls),
        "node_syncs": dict(node_syncs),
        "violations": len(violations),
        "problems": problems,
    }


def _refused_applied(c: dict, unknown_rids: set[str]) -> str:
    where = f"{c['worker']} #{c['n']}: {c['items']} ({c.get('error')})"
    if c.get("request_id") in unknown_rids:  # the first try committed; the retry must replay it
        return f"idempotency: a retried {c['op']} (same request id) was refused, not replayed: {where}"
    return f"refused {c['op']} was applied: {where}"


def _key(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--ops", type=int, default=0, help="stop each worker after this many calls (0: no limit)")
    ap.add_argument("--workers", type=int, default=3, help="rollout worker processes")
    ap.add_argument("--nodes", type=int, default=1, help="node worker processes (3 instances each, node syncs)")
    ap.add_argument("--prompts", type=int, default=0, help="default: enough for the run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench.harness import private_postgres

    out = args.out or Path("reports") / f"backend-kills-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    with private_postgres(out / "home") as url:
        engine = make_engine(url)
        run = setup_run(engine, args.prompts or int(40 + args.seconds * 4))
        logs = drive(url, run, out, args.seconds, args.workers, args.ops, args.nodes)
        result = check(engine, run, logs)
        engine.dispose()
    (out / "result.json").write_text(json.dumps(result, indent=2))
    for pr in result["problems"][:50]:
        print("PROBLEM", pr)
    print(
        f"versions {result['version']}, calls {result['calls']} {result['outcomes']}, "
        f"node syncs {result['node_syncs']}, kills {result['kills']}"
    )
    print(
        f"backend_kills kills={sum(result['kills'].values())} ops={result['calls']} "
        f"unknown={result['outcomes'].get('unknown', 0)} problems={len(result['problems'])} "
        f"violations={result['violations']}"
    )


if __name__ == "__main__":
    sys.exit(main())
