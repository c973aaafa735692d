"""Parameter server across real processes over gloo: push/pull, concurrent pulls of two
versions, integrity checks (in transit and on disk), restart from disk."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path

import pytest
from ps_helpers import SPAWN, WAIT_S, publish, record_published, same, state_dict
from safetensors.torch import load_file

from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.rollout.engines.torch_engine import TorchEngine
from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import ParamServer
from workers.trainer.param_store import ChecksumError, ParamServerError, state_dict_checksum


def _pull_held(addr, version, replied, go, out) -> None:
    """Child process: pull `version` but pause after the PS answered (transfer in flight)."""

    def hold(msg):
        replied.set()
        go.wait(WAIT_S)

    try:
        sd, v, checksum = ParamClient(addr, timeout_s=WAIT_S).pull(version, _on_reply=hold)
        out.put((v, checksum, same(sd, state_dict(version))))
    except Exception as e:  # report instead of dying silently
        out.put(repr(e))


def test_push_pull_roundtrip_persists_and_notifies(start_ps, tmp_path):
    log = tmp_path / "published.jsonl"
    ps = start_ps(on_published=functools.partial(record_published, str(log)))
    c = ps.client
    assert c.latest() is None
    with pytest.raises(ParamServerError, match="not available"):
        c.pull()
    sd = state_dict(1)
    checksum = publish(c, sd, 1)
    assert checksum == state_dict_checksum(sd)
    got, version, got_checksum = c.pull()
    assert (version, got_checksum) == (1, checksum) and same(got, sd)
    latest = c.latest()
    size = sum(t.numel() * t.element_size() for t in sd.values())
    assert (latest["version"], latest["size"], latest["checksum"]) == (1, size, checksum)
    # the PS's file is plain safetensors; the JSON beside it records the same facts
    assert same(load_file(latest["location"]), sd)
    side = json.loads((Path(latest["location"]).with_suffix(".json")).read_text())
    assert side == {"version": 1, "size": size, "checksum": checksum, "file": "v1.safetensors", "committed": True}
    assert [json.loads(x) for x in log.read_text().splitlines()] == [[1, size, checksum, latest["location"]]]


def test_versions_only_move_forward(start_ps):
    c = start_ps().client
    c.push(state_dict(2), 2)
    assert c.push(state_dict(2), 2) == state_dict_checksum(state_dict(2))  # retry: no-op
    c.commit(2, state_dict_checksum(state_dict(2)))  # the trainer published v2 with these
    with pytest.raises(ParamServerError, match="published"):
        c.push(state_dict(3), 2)  # same version, other weights
    with pytest.raises(ParamServerError, match="published"):
        c.push(state_dict(1), 1)
    assert c.latest()["version"] == 2


def test_two_concurrent_pulls_of_two_versions(start_ps):
    ps = start_ps()
    c = ps.client
    publish(c, state_dict(1), 1)
    replied, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    child = SPAWN.Process(target=_pull_held, args=(c.addr, 1, replied, go, out))
    child.start()
    try:
        assert replied.wait(WAIT_S)  # v1 is now being pulled by the child
        publish(c, state_dict(2), 2)
        sd2, v, _ = c.pull()  # latest, while the child's pull of v1 is in flight
        assert v == 2 and same(sd2, state_dict(2))
        sd1, v, _ = c.pull(1)  # v1 kept: a pull of it is in flight
        assert v == 1 and same(sd1, state_dict(1))
    finally:
        go.set()
    assert out.get(timeout=WAIT_S) == (1, state_dict_checksum(state_dict(1)), True)
    child.join(WAIT_S)
    # no pull of v1 in flight any more: the PS dropped it
    with pytest.raises(ParamServerError, match="not available"):
        c.pull(1)
    assert c.latest()["version"] == 2


def test_tampered_transfer_is_detected(start_ps):
    c = start_ps(_tamper_pulls=True).client
    sd = state_dict(5)
    publish(c, sd, 5)
    with pytest.raises(ChecksumError):
        c.pull()
    got, _, _ = c.pull(verify=False)  # the bytes really differ
    assert not same(got, sd)


def test_restart_serves_the_persisted_version(start_ps):
    first = start_ps()
    sd = state_dict(3)
    checksum = publish(first.client, sd, 3)
    first.stop()
    second = start_ps()  # no trainer involved: straight from disk
    assert second.client.latest()["checksum"] == checksum
    got, version, got_checksum = second.client.pull()
    assert (version, got_checksum) == (3, checksum) and same(got, sd)
    publish(second.client, state_dict(4), 4)
    assert sorted(p.name for p in (second.ready.parent / "ps").iterdir()) == ["v4.json", "v4.safetensors"]


def test_a_client_rides_through_a_ps_restart(start_ps):
    """A worker's client (retrying) waits while the PS is down and carries on when it is back
    on the same address; a one-try client fails at once, and a refusal is never retried."""
    first = start_ps()
    sd = state_dict(3)
    publish(first.client, sd, 3)
    host, port = first.client.addr
    first.stop()
    with pytest.raises(OSError):
        ParamClient((host, port), timeout_s=WAIT_S).latest()  # the default: one try
    patient = ParamClient((host, port), timeout_s=WAIT_S, retry_for=WAIT_S)
    pulled: dict = {}
    puller = threading.Thread(target=lambda: pulled.update(zip("svc", patient.pull())))
    puller.start()
    time.sleep(0.5)  # the pull is now retrying against a closed port
    assert puller.is_alive()
    start_ps(port=port)  # the same data dir, on the same port
    puller.join(WAIT_S)
    assert pulled["v"] == 3 and same(pulled["s"], sd)
    assert patient.outage.count == 1 and not patient.outage.down
    with pytest.raises(ParamServerError, match="not available"):
        patient.pull(99)  # a refusal, answered at once


def test_corrupt_file_on_disk_is_refused(tmp_path):
    d = tmp_path / "ps"
    ps = ParamServer(d)  # in-process: the restart check is what this test is about
    ps.start()
    ParamClient(ps.address, timeout_s=WAIT_S).push(state_dict(7), 7)
    ps.stop()
    path = d / "v7.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):
        ParamServer(d)
    assert os.path.exists(path)  # evidence is kept for the operator


def test_engine_runs_on_pulled_weights(start_ps):
    """Trainer -> PS -> rollout instance: what an instance pulls is the pushed model."""
    cfg = TinyConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq=32)
    c = start_ps().client
    publish(c, TinyTransformer(cfg, seed=11).state_dict(), 1)
    sd, version, _ = c.pull()
    pulled, trained = TorchEngine(cfg, model_seed=0), TorchEngine(cfg, model_seed=11)
    pulled.load_weights(sd, version)
    outs = []
    for e in (pulled, trained):
        e.add_request("a", [1, 2, 3], max_new_tokens=8, seed=5)
        outs.append([ev for _ in range(9) for ev in e.step()][-1])
    assert pulled.version == 1 and outs[0] == outs[1] and outs[0].finish_reason in ("eos", "length")
