"""bench/gpu_check.py on a machine without a GPU or vLLM: every check is skipped with the
reason, the summary line is printed and the exit status is 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_skips_cleanly_without_gpu_or_vllm():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    why = gpu_check.missing()
    if why is None:
        pytest.skip("this machine has a GPU and vLLM: run bench/gpu_check.py itself")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[-1] == f"gpu_check passed=0 failed=0 skipped={len(gpu_check.CHECKS)}"
    assert all(line.startswith("SKIP") and why in line for line in lines[:-1])
    assert importlib.util.find_spec("vllm") is None or "GPU" in why
