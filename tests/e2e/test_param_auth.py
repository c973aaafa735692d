"""Who gets in: a parameter server in its own process, holding its run's keys, against real
sockets. The run's trainer key pushes, its rollout key pulls; no key, a wrong key, another
run's key, the wrong role, a replayed handshake, garbage and silence are refused with an error
to the client and a log line, and change nothing. A stranger who learns a transfer's store
port cannot join its group."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket

import pytest
import torch
from ps_helpers import WAIT_S, publish, same, state_dict
from torch.distributed import DistNetworkError, TCPStore

from workers.trainer.param_auth import _PROOF_TAG, MAX_LINE, PSAuthError, PSCredentials, PSKeys, _mac
from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import ParamServer
from workers.trainer.param_transport import _group, open_group

RUN = 7


@pytest.fixture
def authed(start_ps, tmp_path):
    """A PS of run RUN with v0 published; (its process, its keys, a trainer, a rollout client).
    Its log: `ps_log(ps)`."""
    keys = PSKeys.generate(RUN)
    ps = start_ps(auth=keys, handshake_timeout_s=1.0, log=tmp_path / "ps.log")
    trainer = ParamClient(ps.client.addr, timeout_s=WAIT_S, credentials=keys.credentials("trainer"))
    rollout = ParamClient(ps.client.addr, timeout_s=WAIT_S, credentials=keys.credentials("rollout"))
    publish(trainer, state_dict(0), 0)
    return ps, keys, trainer, rollout


def _unchanged(ps, trainer: ParamClient, before: dict, files: set[str]) -> None:
    assert trainer.latest() == before  # nothing published or committed
    assert _files(ps) == files  # nothing written


def ps_log(ps) -> str:
    return (ps.ready.parent / "ps.log").read_text()


def _files(ps) -> set[str]:
    return {p.name for p in (ps.ready.parent / "ps").iterdir()}  # start_ps's data dir


class Raw:
    """A control connection driven by hand, as any process that reaches the port can."""

    def __init__(self, addr: tuple[str, int]):
        self.sock = socket.create_connection(addr, timeout=WAIT_S)
        self.f = self.sock.makefile("rwb")
        self.hello = self.read()

    def send(self, data: bytes) -> None:
        self.f.write(data)
        self.f.flush()

    def send_json(self, obj: dict) -> None:
        self.send(json.dumps(obj).encode() + b"\n")

    def read(self) -> dict:
        line = self.f.readline()
        return json.loads(line) if line else {}

    def closed(self) -> bool:
        return self.f.readline() == b""

    def answer(self, creds: PSCredentials, run: int | None = None) -> dict:
        """The client's handshake line for this connection's challenge (as `run`, if given)."""
        nc = secrets.token_hex(32)
        run = creds.run_id if run is None else run
        return {
            "run": run,
            "role": creds.role,
            "nonce": nc,
            "mac": _mac(creds.key, "client", run, creds.role, self.hello["nonce"], nc),
        }

    def close(self) -> None:
        self.f.close()
        self.sock.close()


@pytest.fixture
def raw(authed):
    opened: list[Raw] = []

    def connect() -> Raw:
        opened.append(Raw(authed[0].client.addr))
        return opened[-1]

    yield connect
    for r in opened:
        r.close()


def test_the_runs_keys_push_and_pull(authed):
    ps, keys, trainer, rollout = authed
    sd = state_dict(1)
    checksum = publish(trainer, sd, 1)
    got, version, got_checksum = rollout.pull()
    assert (version, got_checksum) == (1, checksum) and same(got, sd)
    assert rollout.latest()["version"] == 1
    assert trainer.pull(1)[1] == 1  # a trainer may read what it publishes


def test_unauthenticated_push_and_pull_are_refused_and_change_nothing(authed, raw):
    ps, keys, trainer, rollout = authed
    before, files = trainer.latest(), _files(ps)
    # a client that ignores the challenge and sends its request: refused before it is read
    r = raw()
    assert r.hello == {"staleflow_ps": 1, "auth": "hmac-sha256", "run": RUN, "nonce": r.hello["nonce"]}
    r.send_json({"op": "push", "version": 1, "meta": [["w", "F32", [1 << 20]]]})
    err = r.read()["error"]
    assert err.startswith("PSAuthError: authentication required") and "store_port" not in err and r.closed()
    r = raw()
    r.send_json({"op": "pull"})
    reply = r.read()
    assert "store_port" not in reply and "authentication required" in reply["error"] and r.closed()
    # our own client without credentials does not even ask
    anonymous = ParamClient(ps.client.addr, timeout_s=WAIT_S)
    for call in (lambda: anonymous.push(state_dict(1), 1), anonymous.pull, anonymous.latest):
        with pytest.raises(PSAuthError, match="requires credentials"):
            call()
    _unchanged(ps, trainer, before, files)
    assert "refused connection from 127.0.0.1: authentication required" in ps_log(ps)


def test_wrong_run_wrong_key_and_wrong_role_are_refused(authed, raw):
    ps, keys, trainer, rollout = authed
    before, files = trainer.latest(), _files(ps)
    other = PSKeys.generate(RUN + 1)  # another run's keys
    r = raw()
    r.send_json(r.answer(other.credentials("trainer")))
    assert r.read() == {"error": f"PSAuthError: this PS serves run {RUN}, not run {RUN + 1}"} and r.closed()
    r = raw()  # another run's key passed off as this run's
    r.send_json(r.answer(other.credentials("trainer"), run=RUN))
    assert r.read() == {"error": f"PSAuthError: wrong trainer key for run {RUN} (or a replayed handshake)"}
    with pytest.raises(PSAuthError, match=f"serves run {RUN}, not run {RUN + 1}"):  # our client checks first
        ParamClient(ps.client.addr, credentials=other.credentials("rollout")).pull()
    for role in ("rollout", "trainer"):  # this run, a key that is not the run's
        impostor = ParamClient(ps.client.addr, credentials=PSCredentials(RUN, role, secrets.token_bytes(32)))
        with pytest.raises(PSAuthError, match=f"wrong {role} key for run {RUN}"):
            impostor.push(state_dict(1), 1) if role == "trainer" else impostor.pull()
    r = raw()
    r.send_json({**r.answer(keys.credentials("rollout")), "role": "admin"})
    assert r.read() == {"error": "PSAuthError: role 'admin' has no access to the PS (trainer or rollout)"}
    # the rollout key is the run's, but pushing and committing need the trainer's
    with pytest.raises(PSAuthError, match="role rollout may not push"):
        rollout.push(state_dict(1), 1)
    with pytest.raises(PSAuthError, match="role rollout may not commit"):
        rollout.commit(0, before["checksum"])
    _unchanged(ps, trainer, before, files)
    err = ps_log(ps)
    assert "wrong trainer key for run 7" in err and "refused push from 127.0.0.1 (rollout)" in err


def test_a_replayed_handshake_fails(authed, raw):
    ps, keys, trainer, rollout = authed
    first = raw()
    line = first.answer(keys.credentials("trainer"))
    first.send_json(line)
    assert first.read()["auth"] == "ok"  # a genuine handshake, as recorded on the wire
    again = raw()
    assert again.hello["nonce"] != first.hello["nonce"]
    again.send_json(line)
    assert again.read() == {"error": f"PSAuthError: wrong trainer key for run {RUN} (or a replayed handshake)"}
    assert again.closed()


def test_garbage_and_silence_are_refused(authed, raw):
    ps, keys, trainer, rollout = authed
    before, files = trainer.latest(), _files(ps)
    r = raw()
    r.send(os.urandom(3 * MAX_LINE).replace(b"\n", b"\0"))  # no line end in sight
    assert r.read() == {"error": f"PSAuthError: handshake line from the client longer than {MAX_LINE} bytes"}
    r = raw()
    r.send(b"\x00\xff\xfe garbage\n")
    assert r.read() == {"error": "PSAuthError: handshake from the client is not JSON"}
    r = raw()
    r.send(b"[1, 2, 3]\n")
    assert r.read() == {"error": "PSAuthError: handshake from the client is not a JSON object"}
    silent = raw()  # connects and never authenticates: dropped after the handshake timeout
    assert silent.read() == {"error": "PSAuthError: no credentials within 1s"} and silent.closed()
    _unchanged(ps, trainer, before, files)
    assert "refused connection from 127.0.0.1: no credentials within 1s" in ps_log(ps)


def test_a_stranger_cannot_join_a_transfer(authed):
    """The store port of a transfer in flight is no way in: the rendezvous keys are named by
    the session's secret, so a stranger's group never forms, and the real pull goes on."""
    ps, keys, trainer, rollout = authed
    host = ps.client.addr[0]
    failures: list[str] = []

    def stranger(msg: dict) -> None:
        for attempt in range(5):  # a connect can take over the 1-s store timeout on a busy machine
            try:
                store = TCPStore(host, msg["store_port"], 2, False, datetime.timedelta(seconds=1))
                break
            except DistNetworkError:
                if attempt == 4:
                    raise
        for guess in (None, secrets.token_hex(32)):  # the old fixed prefix, a guessed secret
            try:
                open_group(store, 1, "gloo", host, 1.0, guess)
                failures.append(f"joined with {guess!r}")
            except RuntimeError as e:
                assert not isinstance(e, PSAuthError)  # it timed out waiting for rank 0's keys

    got, version, _ = rollout.pull(_on_reply=stranger)
    assert not failures and version == 0 and same(got, state_dict(0))


def test_a_peer_that_does_not_prove_the_session_gets_no_weights(authed, raw):
    """Even a peer inside the rendezvous (here: the authenticated client itself, misbehaving)
    gets no byte of weights unless its rank proves the session first."""
    ps, keys, trainer, rollout = authed
    creds = keys.credentials("rollout")
    r = raw()
    line = r.answer(creds)
    r.send_json(line)
    assert r.read()["auth"] == "ok"
    secret = _mac(creds.key, "session", RUN, "rollout", r.hello["nonce"], line["nonce"])
    r.send_json({"op": "pull"})
    msg = r.read()
    store = TCPStore(ps.client.addr[0], msg["store_port"], 2, False, datetime.timedelta(seconds=WAIT_S))
    pg = _group(store, 1, "gloo", ps.client.addr[0], WAIT_S, secret)  # joins, but proves nothing
    pg.send([torch.zeros(32, dtype=torch.uint8)], 0, _PROOF_TAG).wait()
    assert r.read() == {
        "error": "PSAuthError: the transfer's peer did not prove the session: another process joined the group"
    }
    assert "did not prove the session" in ps_log(ps)
    got, version, _ = rollout.pull()  # the PS serves on
    assert version == 0 and same(got, state_dict(0))


def test_an_open_ps_and_a_client_with_credentials_do_not_mix(tmp_path):
    """A PS without keys (in-process tests, benchmarks) serves clients without credentials;
    a client with credentials refuses it (anyone could be listening there)."""
    ps = ParamServer(tmp_path)
    addr = ps.start()
    try:
        assert ParamClient(addr).latest() is None
        with pytest.raises(PSAuthError, match="authenticates nobody"):
            ParamClient(addr, credentials=PSKeys.generate(1).credentials("trainer")).push(state_dict(1), 1)
        assert ParamClient(addr).latest() is None
    finally:
        ps.stop()


def test_vllm_workers_pull_with_the_rollout_key(tmp_path):
    """The vLLM worker extension gets the key as plain values (collective_rpc carries msgpack)."""
    from workers.rollout.engines.vllm_engine import StaleFlowWorkerExtension

    keys = PSKeys.generate(RUN)
    ps = ParamServer(tmp_path, auth=keys)
    host, port = ps.start()
    try:
        publish(ParamClient((host, port), credentials=keys.credentials("trainer")), state_dict(3), 0)
        got: list = []
        worker = StaleFlowWorkerExtension()
        worker.device = "cpu"  # type: ignore[attr-defined]
        worker.reload_weights = lambda weights_iterator: got.append(dict(weights_iterator))  # type: ignore[attr-defined]
        with pytest.raises(PSAuthError, match="requires credentials"):
            worker.staleflow_pull(f"{host}:{port}", 0)
        wire = [RUN, "rollout", keys.keys["rollout"].hex()]
        assert worker.staleflow_pull(f"{host}:{port}", 0, 0.0, wire) == 0
        assert same(got[0], state_dict(3))
    finally:
        ps.stop()


def test_staleflow_ps_needs_a_token_that_gets_the_runs_keys(db_url, tmp_path):
    """`staleflow ps --run R` fetches both keys at start: a rollout or reward token is refused
    clearly, before anything listens."""
    import subprocess
    import sys

    from api_helpers import REPO, ApiServer, token

    with ApiServer(db_url) as server:
        run = server.client(token(db_url, "admin")).create_run("ps", batch_size=1, group_size=1, eta=0).id
        for role, needle in (("rollout", "gets no trainer key"), ("reward", "may not do this")):
            out = subprocess.run(
                [sys.executable, "-m", "staleflow_cli.main", "ps", "--run", str(run), "--data-dir", str(tmp_path)],
                cwd=REPO,
                env={**os.environ, "STALEFLOW_API_URL": server.url, "STALEFLOW_TOKEN": token(db_url, role, run)},
                capture_output=True,
                text=True,
                timeout=WAIT_S,
            )
            said = " ".join(out.stderr.split())  # the console wraps long lines
            assert out.returncode == 1, said
            assert "the parameter server needs the run's keys (a trainer or admin token)" in said
            assert needle in said
