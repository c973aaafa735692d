"""The model-based test at benchmark scale: the reference model and PostgreSQL driven by the
same random operations, their whole state compared and the complete audit
(`staleness_violations`) checked after every step (tests/db/test_protocol_model.py, whose COVERAGE
the chunks must meet together).

CI runs 60 derandomized examples of up to 80 steps. This runs random examples in chunks of
`--chunk` (each chunk one pytest process with its own Hypothesis seed) until `--ops`
operations ran or `--seconds` passed, printing the running total after each chunk.
Last line: `model ops=O examples=E failures=F`.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/db/test_protocol_model.py"  # run in chunks, one pytest process each


def coverage() -> tuple[str, ...]:
    """The outcomes the test names: read from the test module, so the list exists once."""
    sys.path.insert(0, str(REPO))
    from tests.db.test_protocol_model import COVERAGE

    return COVERAGE


def run_chunk(examples: int, seed: int) -> tuple[dict[str, int], bool, str]:
    env = {**os.environ, "STALEFLOW_MODEL_EXAMPLES": str(examples), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=0",
            f"--hypothesis-seed={seed}",
            f"{TEST}::test_reference_and_database_agree",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    out = proc.stdout + proc.stderr
    seen = re.search(r"\{'steps'[^{}]*\}", out)
    return (ast.literal_eval(seen.group(0)) if seen else {}), proc.returncode == 0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=100_000, help="stop after this many operations")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="or after this long")
    ap.add_argument("--chunk", type=int, default=100, help="examples per pytest process")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    started, ops, examples, failures, chunk = time.monotonic(), 0, 0, 0, 0
    met: Counter = Counter()
    while ops < args.ops and time.monotonic() - started < args.seconds:
        seen, ok, out = run_chunk(args.chunk, args.seed + chunk)
        met.update(seen)
        n = seen.get("steps", 0)
        chunk += 1
        ops, examples, failures = ops + n, examples + args.chunk, failures + (not ok)
        print(
            f"{time.monotonic() - started:7.0f} s  chunk {chunk}: {n} ops ({'ok' if ok else 'FAILED'}), "
            f"total {ops} ops in {examples} examples",
            flush=True,
        )
        if not ok:
            print(out[-4000:], flush=True)
            break
    print("outcomes met:", dict(met))
    missing = [o for o in coverage() if not met[o]]
    if missing and not failures:
        print(f"vacuous: never met {missing}")
        failures += 1
    print(f"model ops={ops} examples={examples} failures={failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
