"""Parameter-server bandwidth: push and pull over gloo between real processes, next to a
plain in-memory copy of the same state dict.

    python bench/params.py [--sizes-mb 100,1000] [--repeat 3] [--dir DIR]

The PS runs in its own process (workers.trainer.param_server.main); this process is the trainer
(push) and a rollout instance (pull). Rows, in MB/s (1 MB = 1e6 bytes), median of
--repeat runs:
  memcpy       tensor.clone() of every tensor of the dict
  push         end to end: flatten + sha256 here, gloo send, sha256 + fsync'd safetensors
               write + publish on the PS (what the trainer waits for)
  pull         gloo transfer into one buffer, no verification (verify=False)
  pull+verify  the default pull: the same plus the sha256 check
  sha256       hashing alone, for scale
The last line is gloo_pull/memcpy for the largest size (pull row / memcpy row).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import main
from workers.trainer.param_store import flat_checksum, flatten

_TENSOR_BYTES = 16_000_000  # 4M float32 per tensor, roughly a 7B model's smaller matrices


def make_state_dict(total_bytes: int) -> dict[str, torch.Tensor]:
    sd, left, i = {}, total_bytes, 0
    while left > 0:
        n = min(_TENSOR_BYTES, left) // 4
        sd[f"layers.{i}.weight"] = torch.randn(max(n, 1))
        left -= max(n, 1) * 4
        i += 1
    return sd


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_ps(data_dir: Path) -> tuple[mp.Process, ParamClient]:
    ready = data_dir / "ready.json"
    proc = mp.get_context("spawn").Process(
        target=main, args=(str(data_dir / "ps"),), kwargs={"ready_file": str(ready)}, daemon=True
    )
    proc.start()
    while not ready.exists():
        if not proc.is_alive():
            raise SystemExit("PS failed to start")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, ParamClient((info["host"], info["port"]), timeout_s=1800)


def bench_size(client: ParamClient, size_mb: int, repeat: int, version: int) -> tuple[dict, int]:
    nbytes = size_mb * 1_000_000
    progress(f"[{size_mb} MB] building state dict ...")
    sd = make_state_dict(nbytes)
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "push", "pull", "pull+verify", "sha256")}
    for r in range(repeat):
        times["memcpy"].append(timed(lambda: {k: t.clone() for k, t in sd.items()}))
        progress(f"[{size_mb} MB] {r + 1}/{repeat} memcpy {times['memcpy'][-1]:.3f}s")
        version += 1
        pushed = {}
        times["push"].append(timed(lambda: pushed.update(checksum=client.push(sd, version))))
        progress(f"[{size_mb} MB] {r + 1}/{repeat} push   {times['push'][-1]:.3f}s (v{version})")
        client.commit(version, pushed["checksum"])  # as the trainer does: plain pulls get committed weights only
        times["pull"].append(timed(lambda: client.pull(verify=False)))
        progress(f"[{size_mb} MB] {r + 1}/{repeat} pull   {times['pull'][-1]:.3f}s")
        holder = {}
        times["pull+verify"].append(timed(lambda: holder.update(r=client.pull())))
        got = holder.pop("r")[0]
        assert all(torch.equal(got[k], sd[k]) for k in sd), "pulled weights differ"
        del got
        progress(f"[{size_mb} MB] {r + 1}/{repeat} pull+verify {times['pull+verify'][-1]:.3f}s")
        flat, metas = flatten(sd)
        times["sha256"].append(timed(lambda f=flat, m=metas: flat_checksum(f, m)))
        del flat
    return {k: nbytes / 1e6 / statistics.median(v) for k, v in times.items()}, version


def main_cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="100,1000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="PS data directory (default: a temp dir)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="sf-bench-params-", dir=a.dir) as d:
        proc, client = start_ps(Path(d))
        try:
            results, version = {}, 0
            for size in sizes:
                results[size], version = bench_size(client, size, a.repeat, version)
        finally:
            proc.terminate()
            proc.join()
    rows = ["memcpy", "push", "pull", "pull+verify", "sha256"]
    print(f"\nPS bandwidth, gloo over loopback, {torch.get_num_threads()} torch threads, median of {a.repeat} (MB/s)")
    print(f"{'':<12}" + "".join(f"{f'{s} MB':>12}" for s in sizes))
    for row in rows:
        print(f"{row:<12}" + "".join(f"{results[s][row]:>12.0f}" for s in sizes))
    big = results[max(sizes)]
    print(f"gloo_pull/memcpy={big['pull'] / big['memcpy']:.3f}")


if __name__ == "__main__":
    main_cli()
