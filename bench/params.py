"""Parameter-server bandwidth and what a pull costs in memory: push and pull over gloo between
real processes, next to a plain in-memory copy of the same state dict.

    python bench/params.py [--sizes-mb 100,1000] [--buckets-mib 16,64] [--repeat 3] [--dir DIR]
                           [--device cuda]

The PS runs in its own process (workers.trainer.param_server.main); this process is the trainer
(push) and a rollout instance (pull). Rows, in MB/s (1 MB = 1e6 bytes), median of
--repeat runs:
  memcpy       tensor.clone() of every tensor of the dict
  push         end to end: flatten + sha256 here, gloo send, sha256 + fsync'd safetensors
               write + publish on the PS (what the trainer waits for)
  pull         gloo transfer into one buffer, no verification (verify=False)
  pull+verify  the default pull: the same plus the sha256 check
  sha256       hashing alone, for scale
Then, per bucket size, a rollout instance's pull as the engines do it -- streamed in buckets
(ParamClient.pull_into, verified) and copied in place into a model of the same shapes -- in
a fresh process holding that model: its MB/s, ÷ memcpy measured in that process, and the
peak extra memory of the pull as a fraction of the model's size (CPU: resident set sampled
every millisecond during the pull, minus before; --device cuda: torch.cuda.max_memory_allocated
minus before), beside what the transport held (RecvAccount: the largest bucket), the goal
0.1 + held, and the whole-buffer pull's (pull()).
The last line: gloo_pull/memcpy (the whole-buffer pull, largest size), bucketed_pull/memcpy and
peak_extra_frac (largest size, smallest bucket).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import main
from workers.trainer.param_store import flat_checksum, flatten, tensors_of
from workers.trainer.param_transport import RecvAccount

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


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may then be low, never high
        pass


class PeakExtra:
    """Peak memory above the level at start: CUDA's allocator statistics on a GPU, else the
    resident set sampled every millisecond by a thread (a bucket is written whole, so its
    pages are resident for the whole time it is held)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> PeakExtra:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _trim()  # free heap pages back to the OS, or a bucket may land on them unseen
            self.base = self.peak = _rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.base


def _instance(addr, size_mb: int, bucket_mib: list[int], repeat: int, device: str, out) -> None:
    """A rollout instance in its own process: a model of the pushed shapes; per bucket size,
    streamed pulls into it in place; then a whole-buffer pull. Reports to `out`."""
    client = ParamClient(addr, timeout_s=1800)
    model = {k: torch.zeros_like(t, device=device) for k, t in make_state_dict(size_mb * 1_000_000).items()}
    nbytes = sum(t.numel() * t.element_size() for t in model.values())

    def copy_in(version: int, received) -> None:  # what the torch and hf engines' install does
        with torch.no_grad():
            for name, t in tensors_of(received):
                model[name].copy_(t)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    memcpy = statistics.median(timed(lambda: ({k: t.clone() for k, t in model.items()}, sync())) for _ in range(repeat))
    rows = {}
    for mib in bucket_mib:
        times, peaks, account = [], [], RecvAccount()
        for _ in range(repeat):
            with PeakExtra(device) as peak:
                pull = lambda: client.pull_into(copy_in, device=device, bucket_bytes=mib << 20, account=account)  # noqa: E731
                times.append(timed(lambda: (pull(), sync())))
            peaks.append(peak.extra)
        t = statistics.median(times)
        rows[mib] = (nbytes / 1e6 / t, memcpy / t, max(peaks) / nbytes, account.peak_bytes / nbytes)
        out.put(
            ("progress", f"[{size_mb} MB] bucket {mib} MiB: {rows[mib][0]:.0f} MB/s, peak extra {rows[mib][2]:.3f}")
        )
    with PeakExtra(device) as peak:

        def whole() -> None:
            sd, _, _ = client.pull(device=device)
            with torch.no_grad():
                for k, t in sd.items():
                    model[k].copy_(t)

        whole()
    out.put(("done", rows, peak.extra / nbytes, nbytes / 1e6 / memcpy))


def bench_instance(addr, size_mb: int, bucket_mib: list[int], repeat: int, device: str) -> tuple[dict, float, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_instance, args=(addr, size_mb, bucket_mib, repeat, device, out), daemon=True)
    proc.start()
    while True:
        msg = out.get(timeout=3600)
        if msg[0] == "progress":
            progress(msg[1])
        else:
            proc.join()
            return msg[1], msg[2], msg[3]


def main_cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="100,1000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--buckets-mib", default="16,64", help="bucket sizes of the streamed pulls (MiB)")
    ap.add_argument("--device", default="cpu", help="where the pulling instance's model lives")
    ap.add_argument("--dir", help="PS data directory (default: a temp dir)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    bucket_mib = sorted(int(b) for b in a.buckets_mib.split(","))
    with tempfile.TemporaryDirectory(prefix="sf-bench-params-", dir=a.dir) as d:
        proc, client = start_ps(Path(d))
        try:
            results, version = {}, 0
            streamed = {}
            for size in sizes:
                results[size], version = bench_size(client, size, a.repeat, version)
                streamed[size] = bench_instance(client.addr, size, bucket_mib, a.repeat, a.device)
        finally:
            proc.terminate()
            proc.join()
    rows = ["memcpy", "push", "pull", "pull+verify", "sha256"]
    print(f"\nPS bandwidth, gloo over loopback, {torch.get_num_threads()} torch threads, median of {a.repeat} (MB/s)")
    print(f"{'':<12}" + "".join(f"{f'{s} MB':>12}" for s in sizes))
    for row in rows:
        print(f"{row:<12}" + "".join(f"{results[s][row]:>12.0f}" for s in sizes))
    print(f"\nStreamed pull into a model on {a.device} (verified, copied in place), median of {a.repeat}")
    print("(fractions of the model's size; held: the largest bucket, one tensor where that is larger)")
    head = f"{'model':>8} {'bucket':>8} {'MB/s':>8} {'÷memcpy':>8} {'held':>6} {'peak extra':>11} {'goal':>6}"
    print(f"{head} {'whole-buffer pull':>18}")
    for size in sizes:
        rows, whole, memcpy = streamed[size]
        for mib, (mbps, ratio, frac, held) in rows.items():
            cells = f"{mbps:>8.0f} {ratio:>8.3f} {held:>6.3f} {frac:>11.3f} {0.1 + held:>6.3f}"
            print(f"{size:>6}MB {mib:>5}MiB {cells} {whole:>18.3f}")
        print(f"{size:>6}MB {'memcpy':>8} {memcpy:>8.0f}")
    big = results[max(sizes)]
    mbps, ratio, frac, _ = streamed[max(sizes)][0][bucket_mib[0]]
    print(
        f"gloo_pull/memcpy={big['pull'] / big['memcpy']:.3f} bucketed_pull/memcpy={ratio:.3f} "
        f"peak_extra_frac={frac:.3f} bucket_mib={bucket_mib[0]} model_mb={max(sizes)}"
    )


if __name__ == "__main__":
    main_cli()
