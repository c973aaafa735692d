"""A parameter server in its own process, and tensors to push through it (tests that need a PS)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import main

SPAWN = mp.get_context("spawn")
WAIT_S = 60  # generous guard so a broken PS fails the test instead of hanging it


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.0.weight": torch.randn(64, 33, generator=g),
        "layer.0.bias": torch.randn(33, generator=g).to(torch.bfloat16),
        "emb": torch.randn(100, 16, generator=g).half(),
        "step": torch.tensor([seed], dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def publish(c: ParamClient, sd: dict, version: int) -> str:
    """What the trainer does: push, (publish in the database), commit the checksum."""
    checksum = c.push(sd, version)
    c.commit(version, checksum)
    return checksum


def record_published(path: str, version: int, size: int, checksum: str, location: str) -> None:
    with open(path, "a") as f:
        f.write(json.dumps([version, size, checksum, location]) + "\n")


def _main_logging_to(log: str, *args, **kw) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    main(*args, **kw)


class PSProcess:
    """A PS in its own (spawned) process, serving on a free port; its log in `log` if given."""

    def __init__(self, data_dir: Path, log: Path | None = None, **kw):
        self.ready = data_dir.parent / f"ready-{time.monotonic_ns()}.json"
        self.proc = SPAWN.Process(
            target=main if log is None else _main_logging_to,
            args=(str(data_dir),) if log is None else (str(log), str(data_dir)),
            kwargs={"ready_file": str(self.ready), "transfer_timeout_s": WAIT_S, **kw},
        )
        self.proc.start()
        deadline = time.monotonic() + WAIT_S
        while not self.ready.exists():
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start (exit code {self.proc.exitcode})")
            time.sleep(0.02)
        info = json.loads(self.ready.read_text())
        self.client = ParamClient((info["host"], info["port"]), timeout_s=WAIT_S)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(WAIT_S)
        assert self.proc.exitcode == 0  # SIGTERM is a clean shutdown
