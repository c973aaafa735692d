"""Who may talk to the parameter server: a challenge-response handshake on every control
connection, before any request is read, and a proof of the same session on each transfer's
`torch.distributed` group before a byte of weights moves.

Keys. The API keeps a random secret per run and hands out keys derived from it by role
(`GET /v1/runs/{run}/param-secret`): a rollout token gets the rollout key, a trainer or admin
token the trainer and rollout keys. The PS holds both keys of its run; a client holds the
key of the role it acts as. Keys never cross the PS's connections.

Handshake (JSON lines, each at most MAX_LINE bytes):
    PS -> client   {"staleflow_ps": 1, "auth": "hmac-sha256", "run": R, "nonce": Ns}
    client -> PS   {"run": R, "role": ROLE, "nonce": Nc, "mac": HMAC(key[ROLE], client|R|ROLE|Ns|Nc)}
    PS -> client   {"auth": "ok", "mac": HMAC(key[ROLE], server|R|ROLE|Ns|Nc)}   or {"error": ...}
The PS's fresh nonce makes a replayed client line fail; its own MAC proves to the client that
it talks to the run's PS (a trainer sends its weights to no one else). Both sides then derive
the session secret HMAC(key[ROLE], session|R|ROLE|Ns|Nc): it names the transfer's keys in the
rendezvous store (a peer without it cannot find them) and, over gloo, the client's rank proves
it on the group before the PS sends or accepts weights (`prove_peer` / `check_peer`).

Operations by role: `push` and `commit` need the trainer key; `pull` and `latest` the rollout
key (or the trainer's: a trainer may read what it publishes).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import secrets
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.trainer.param_store import ParamServerError

if TYPE_CHECKING:
    from workers.client import StaleFlowClient

log = logging.getLogger("staleflow.ps")

PROTOCOL = 1
SCHEME = "hmac-sha256"
MAX_LINE = 4096  # bytes of a handshake line: nothing larger is read from an unauthenticated peer
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that has not authenticated by then is dropped
TRAINER, ROLLOUT = "trainer", "rollout"
ROLES_OF_OP = {"push": (TRAINER,), "commit": (TRAINER,), "pull": (ROLLOUT, TRAINER), "latest": (ROLLOUT, TRAINER)}
_PROOF_TAG = 1 << 30  # a tag no data chunk uses


class PSAuthError(ParamServerError):
    """The PS refused the connection's credentials, or the PS failed to prove it holds the run's keys."""


@dataclass(frozen=True)
class PSKeys:
    """What a PS verifies with: its run and one key per role (from the API)."""

    run_id: int
    keys: dict[str, bytes]

    @classmethod
    def generate(cls, run_id: int) -> PSKeys:
        """Random keys, for a PS and its clients in one program (tests, benchmarks)."""
        return cls(run_id, {r: secrets.token_bytes(32) for r in (TRAINER, ROLLOUT)})

    def credentials(self, role: str) -> PSCredentials:
        return PSCredentials(self.run_id, role, self.keys[role])

    @classmethod
    def fetch(cls, client: StaleFlowClient, run_id: int) -> PSKeys:
        """The keys a PS of `run_id` verifies with, from the API (a trainer or admin token)."""
        keys = _fetch(client, run_id)
        missing = {TRAINER, ROLLOUT} - keys.keys()
        if missing:
            raise PSAuthError(f"a PS needs a trainer or admin token: this one gets no {', '.join(sorted(missing))} key")
        return cls(run_id, keys)

    def __repr__(self) -> str:  # never print the keys
        return f"PSKeys(run_id={self.run_id}, roles={sorted(self.keys)})"


@dataclass(frozen=True)
class PSCredentials:
    """What a client proves: its run, the role it acts as and that role's key (from the API)."""

    run_id: int
    role: str
    key: bytes

    def __repr__(self) -> str:  # never print the key
        return f"PSCredentials(run_id={self.run_id}, role={self.role!r})"

    @classmethod
    def fetch(cls, client: StaleFlowClient, run_id: int, role: str) -> PSCredentials:
        """This token's `role` key for `run_id`'s PS, from the API."""
        keys = _fetch(client, run_id)
        if role not in keys:
            raise PSAuthError(f"this token gets no {role} key for run {run_id}'s PS (only {', '.join(keys) or 'none'})")
        return cls(run_id, role, keys[role])


def _fetch(client: StaleFlowClient, run_id: int) -> dict[str, bytes]:
    return {r: bytes.fromhex(k) for r, k in client.param_secret(run_id).keys.items()}


@dataclass(frozen=True)
class Session:
    """An authenticated connection: who, and the secret its transfer is bound to (None: the
    PS authenticates nobody, in-process tests and benchmarks only)."""

    role: str | None
    secret: str | None


OPEN = Session(None, None)


def _mac(key: bytes, label: str, run_id: int, role: str, ns: str, nc: str) -> str:
    msg = f"staleflow-ps/{PROTOCOL} {label}|{run_id}|{role}|{ns}|{nc}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _send(w: io.BufferedIOBase, obj: dict) -> None:
    w.write(json.dumps(obj).encode() + b"\n")
    w.flush()


def _line(r: io.BufferedIOBase, who: str) -> dict:
    raw = r.readline(MAX_LINE + 1)
    if not raw:  # an outage (a PS restarting), not a refusal: the client retries it
        raise ConnectionResetError(f"{who} closed the connection during the handshake")
    if len(raw) > MAX_LINE or not raw.endswith(b"\n"):
        raise PSAuthError(f"handshake line from {who} longer than {MAX_LINE} bytes")
    try:
        msg = json.loads(raw)
    except ValueError:
        raise PSAuthError(f"handshake from {who} is not JSON") from None
    if not isinstance(msg, dict):
        raise PSAuthError(f"handshake from {who} is not a JSON object")
    return msg


# ---- the PS's side ----------------------------------------------------------------------------
def accept(
    sock: socket.socket,
    r: io.BufferedIOBase,
    w: io.BufferedIOBase,
    keys: PSKeys | None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> Session:
    """Authenticate a fresh connection (PS side). PSAuthError says why it is refused: the
    caller tells the peer, logs it and closes the connection without reading anything else."""
    if keys is None:
        _send(w, {"staleflow_ps": PROTOCOL, "auth": "none"})
        return OPEN
    ns = secrets.token_hex(32)
    _send(w, {"staleflow_ps": PROTOCOL, "auth": SCHEME, "run": keys.run_id, "nonce": ns})
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        try:
            msg = _line(r, "the client")
        except TimeoutError:
            raise PSAuthError(f"no credentials within {timeout_s:g}s") from None
        run, role, nc, mac = msg.get("run"), msg.get("role"), msg.get("nonce"), msg.get("mac")
        if not (isinstance(role, str) and isinstance(nc, str) and isinstance(mac, str) and isinstance(run, int)):
            raise PSAuthError(
                "authentication required: expected {run, role, nonce, mac} (a client with the run's PS key)"
            )
        if run != keys.run_id:
            raise PSAuthError(f"this PS serves run {keys.run_id}, not run {run}")
        key = keys.keys.get(role)
        if key is None:
            raise PSAuthError(f"role {role!r} has no access to the PS (trainer or rollout)")
        if not 16 <= len(nc) <= 128 or not hmac.compare_digest(mac, _mac(key, "client", run, role, ns, nc)):
            raise PSAuthError(f"wrong {role} key for run {run} (or a replayed handshake)")
        _send(w, {"auth": "ok", "mac": _mac(key, "server", run, role, ns, nc)})
        return Session(role, _mac(key, "session", run, role, ns, nc))
    finally:
        sock.settimeout(previous)


def authorize(session: Session, op: object) -> None:
    """PSAuthError unless the session's role may perform `op` (an open PS allows everything)."""
    if session.role is None:
        return
    roles = ROLES_OF_OP.get(op) if isinstance(op, str) else None
    if roles is not None and session.role not in roles:
        raise PSAuthError(f"role {session.role} may not {op} (needs {' or '.join(roles)})")


# ---- the client's side ------------------------------------------------------------------------
def connect(r: io.BufferedIOBase, w: io.BufferedIOBase, creds: PSCredentials | None, where: str) -> Session:
    """Answer the PS's challenge and check its proof (client side)."""
    hello = _line(r, f"the PS at {where}")
    if hello.get("staleflow_ps") != PROTOCOL:
        raise PSAuthError(f"{where} is not a StaleFlow parameter server (protocol {PROTOCOL})")
    if hello.get("auth") == "none":
        if creds is not None:  # anyone could be listening there: keep the weights
            raise PSAuthError(f"the PS at {where} authenticates nobody; refusing to use it with credentials")
        return OPEN
    if creds is None:
        raise PSAuthError(f"the PS at {where} requires credentials (the run's PS key; pass the run and a token)")
    ns, run = str(hello.get("nonce")), hello.get("run")
    if run != creds.run_id:
        raise PSAuthError(f"the PS at {where} serves run {run}, not run {creds.run_id}")
    nc = secrets.token_hex(32)
    mac = _mac(creds.key, "client", creds.run_id, creds.role, ns, nc)
    _send(w, {"run": creds.run_id, "role": creds.role, "nonce": nc, "mac": mac})
    reply = _line(r, f"the PS at {where}")
    if "error" in reply:
        raise PSAuthError(str(reply["error"]))
    if not hmac.compare_digest(str(reply.get("mac")), _mac(creds.key, "server", creds.run_id, creds.role, ns, nc)):
        raise PSAuthError(f"the PS at {where} does not hold run {creds.run_id}'s keys")
    return Session(creds.role, _mac(creds.key, "session", creds.run_id, creds.role, ns, nc))


# ---- the transfer's group -----------------------------------------------------------------------
def _proof(secret: str) -> bytes:
    return hmac.new(secret.encode(), b"staleflow-ps transfer peer", hashlib.sha256).digest()


def _needs_proof(pg) -> bool:
    # gloo's pair handshake carries no secret: a stranger who races to its listening port
    # could take the peer's place. NCCL's bootstrap checks the random magic of its unique id,
    # which lives under the session-named store keys: no proof needed (nor a device to send
    # it from, which may differ from the weights' device).
    return bool(pg.name() == "gloo")


def prove_peer(pg, secret: str | None, peer: int) -> None:
    """The client's rank: send the session's proof to the PS's rank."""
    import torch

    if secret is not None and _needs_proof(pg):
        pg.send([torch.tensor(list(_proof(secret)), dtype=torch.uint8)], peer, _PROOF_TAG).wait()


def check_peer(pg, secret: str | None, peer: int) -> None:
    """The PS's rank: PSAuthError unless the group's other rank proves the session."""
    import torch

    if secret is None or not _needs_proof(pg):
        return
    got = torch.empty(32, dtype=torch.uint8)
    pg.recv([got], peer, _PROOF_TAG).wait()
    if not hmac.compare_digest(bytes(got.tolist()), _proof(secret)):
        raise PSAuthError("the transfer's peer did not prove the session: another process joined the group")
