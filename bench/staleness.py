"""The staleness experiment (docs/benchmarks.md, "Staleness experiment"): a thin wrapper over
`staleflow experiment staleness`, writing bench/results/staleness.{md,json,png}.

    python bench/staleness.py                                   # η 0,1,2,4,8, TIS on and off, 3 seeds
    python bench/staleness.py --etas 0,2,8 --seeds 2 --steps 30 # a reduced run

Every option is passed through to the command (see `staleflow experiment staleness --help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ahead of bench/, whose api.py would shadow the api package

from staleflow_cli.experiment import app


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / "bench" / "results")]
    app(["staleness", *args])


if __name__ == "__main__":
    main()
