"""The model-based test at benchmark scale: the reference model and PostgreSQL driven by the
same random operations, their whole state compared and the complete audit
(`staleness_violations`) checked after every step (tests/test_protocol_model.py).

CI runs 60 derandomized examples of 80 steps; this runs `--examples` random ones (default
1,300 x 80 = 104,000 operations) and prints how many operations ran and what they met.
Last line: `model ops=O examples=E failures=F`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=1300, help="random runs of up to 80 operations each")
    args = ap.parse_args()
    env = {**os.environ, "STALEFLOW_MODEL_EXAMPLES": str(args.examples), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "timeout=0",
         "tests/test_protocol_model.py::test_reference_and_database_agree"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    out = proc.stdout + proc.stderr
    seen = re.search(r"\{'steps'.*?\}|\{[^{}]*'steps': \d+[^{}]*\}", out)
    print(seen.group(0) if seen else out[-3000:])
    steps = int(re.search(r"'steps': (\d+)", seen.group(0)).group(1)) if seen else 0
    print(f"{time.monotonic() - started:.0f} s, pytest exit {proc.returncode}")
    print(f"model ops={steps} examples={args.examples} failures={int(proc.returncode != 0)}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
