"""The trainer SDK: bring your own trainer (FSDP, Megatron, veRL, TRL, a plain PyTorch loop).

StaleFlow decides *which* samples train each step (the staleness bound, the group filter); your
trainer decides *how*. Three calls connect them::

    from workers.sdk import TrainerClient

    sf = TrainerClient("http://api:8000", token, "my-run", ps="ps-host:29600")  # a run's name or id
    sf.start(model.state_dict())           # version 0 on the parameter server, if not there yet
    while True:
        batch = sf.next_batch(timeout=600)  # the next ready buffer, as tensors
        loss = my_loss(model, batch)        # batch.input_ids, .response_mask, .logprobs, .rewards ...
        loss.backward(); opt.step(); opt.zero_grad()
        sf.publish(batch.version, model.state_dict())  # push the weights, publish version + 1

`next_batch` consumes buffers in version order (buffer v trains model v into v + 1);
`publish` pushes the weights to the parameter server as version v + 1 and publishes it with
the consume's fence, so a second trainer that consumed the same buffer later fences this one
out (`TrainerError`) instead of both publishing. Rollout workers pull the published weights
from the parameter server. The SDK keeps no checkpoint: a trainer that restarts resumes from
its own checkpoint of the model at the run's version (`TrainerClient.version`).

Layout of a `Batch` (S samples, T = the longest prompt + response, right-padded):
position t of a sample holds token `input_ids[t]`; `response_mask[t]` is 1 where that token was
generated (the loss mask: 0 on the prompt, padding and, in multi-turn trajectories, the
environment's observations), and `logprobs[t]` is the generating model's log-probability of it (0 elsewhere).
To compare with the trainer's own log-probs, take `log_softmax(logits[:, :-1])` gathered at
`input_ids[:, 1:]` against `logprobs[:, 1:]` and `response_mask[:, 1:]` (see
docs/examples/train_hf_sdk.py). The engines' log-probs are of softmax(logits / T) at the run's
sampling temperature T (`Batch.temperature`): divide the logits by it too, or the ratio is
biased at T != 1.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.client import RunRef, StaleFlowClient
from workers.trainer.loop import TrainerError, check_start, publish_fenced
from workers.trainer.param_auth import PSCredentials
from workers.trainer.param_client import ParamClient
from workers.trainer.param_store import cast_dtype, state_dict_checksum
from workers.wire.models import BatchOut

__all__ = ["Batch", "TrainerClient", "TrainerError", "to_batch"]


@dataclass
class Batch:
    """One training step's samples as tensors; row i is sample i, `group_ids` say which rows
    share a prompt (the GRPO group)."""

    version: int  # the buffer: trains model `version` into `version + 1`
    consume_fence: int  # what `publish` quotes (kept for you by TrainerClient)
    input_ids: torch.Tensor  # [S, T] long: prompt + response, right-padded with pad_id
    attention_mask: torch.Tensor  # [S, T] long: 1 on real tokens
    response_mask: torch.Tensor  # [S, T] float: 1 on generated tokens (the loss mask; 0 on observations)
    logprobs: torch.Tensor  # [S, T] float: the generating model's log-prob of each generated token
    rewards: torch.Tensor  # [S] float
    versions: torch.Tensor  # [S] long: V_traj, the oldest model version that generated the sample
    staleness: torch.Tensor  # [S] long: version - V_traj (within the run's eta)
    group_ids: torch.Tensor  # [S] long
    prompt_lengths: torch.Tensor  # [S] long
    meta: list[dict[str, Any]]  # per sample: its prompt's metadata (e.g. the reference answer)
    raw: BatchOut  # everything the API returned (sample ids, segments, finish reasons)
    # the run's sampling parameters: `logprobs` are of softmax(logits / temperature) (top_p
    # then truncates what was sampled from), so the trainer's own log-probs must divide too
    temperature: float = 1.0
    top_p: float = 1.0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def to_batch(out: BatchOut, pad_id: int = 0, temperature: float = 1.0, top_p: float = 1.0) -> Batch:
    """The API's batch as right-padded tensors (see `Batch`), with the run's sampling parameters."""
    rows: list[tuple[Sequence[int], Sequence[int], Sequence[float], Sequence[int]]] = []
    rewards, versions, groups, metas = [], [], [], []
    for g in out.groups:
        for s in g.samples:
            if len(s.logprobs) != len(s.tokens):
                raise TrainerError(f"sample {s.sample_id}: {len(s.tokens)} tokens but {len(s.logprobs)} log-probs")
            rows.append((g.prompt_tokens, s.tokens, s.logprobs, s.loss_mask))
            rewards.append(s.reward)
            versions.append(s.v_traj)
            groups.append(g.group_id)
            metas.append(g.meta)
    n, width = len(rows), max((len(p) + len(r) for p, r, _, _ in rows), default=0)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response = torch.zeros((n, width))
    logprobs = torch.zeros((n, width))
    for i, (prompt, tokens, lps, mask) in enumerate(rows):
        p, r = len(prompt), len(tokens)
        ids[i, : p + r] = torch.tensor([*prompt, *tokens], dtype=torch.long)
        attention[i, : p + r] = 1
        response[i, p : p + r] = torch.tensor(mask, dtype=torch.float32)  # 0 on observations
        logprobs[i, p : p + r] = torch.tensor(lps, dtype=torch.float32)
    v = torch.tensor(versions, dtype=torch.long)
    return Batch(
        version=out.version,
        consume_fence=out.consume_fence,
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        logprobs=logprobs,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        versions=v,
        staleness=out.version - v,
        group_ids=torch.tensor(groups, dtype=torch.long),
        prompt_lengths=torch.tensor([len(p) for p, _, _, _ in rows], dtype=torch.long),
        meta=metas,
        raw=out,
        temperature=temperature,
        top_p=top_p,
    )


class TrainerClient:
    """A trainer's view of one run over the REST API (a token of role `trainer`) and of the
    parameter server (`ps`: "HOST:PORT" of `staleflow ps`, or None when the rollout engines
    get weights some other way; then `publish` only records the version). `push_dtype`: what
    the weights travel as (floating tensors, never wider than their own; None: as given),
    e.g. torch.bfloat16 for a model trained in fp32 on a GPU."""

    def __init__(
        self,
        api_url: str | Sequence[str] | None,
        token: str | None,
        run_id: RunRef,
        *,
        ps: str | tuple[str, int] | ParamClient | None = None,
        pad_id: int = 0,
        poll_s: float = 10.0,
        push_dtype: torch.dtype | None = None,
    ):
        self.client = StaleFlowClient(api_url, token)
        self.push_dtype = push_dtype
        self.pad_id, self.poll_s = pad_id, poll_s
        status = self.client.run_status(run_id)  # a name or an id: the API resolves either
        self.run_id: int = status.run_id
        self.version = status.version  # the next buffer to consume
        config = status.config.model_dump()  # the run's sampling parameters go with each Batch
        self.temperature: float = config["temperature"]
        self.top_p: float = config["top_p"]
        if ps is not None and not isinstance(ps, ParamClient):  # the run's trainer key, from the API
            ps = ParamClient(ps, retry_for=60.0, credentials=PSCredentials.fetch(self.client, self.run_id, "trainer"))
        self.ps = ps
        self._fences: dict[int, int] = {}  # buffer -> its consume fence, until published

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, state_dict: Mapping[str, torch.Tensor], *, allow_fresh: bool = False) -> None:
        """Serve the initial weights as version 0 (rollout workers wait for them), unless the
        parameter server already has the run's current version (a restarted trainer).

        A run past version 0 trains on from its published weights: `state_dict` must be them
        (its checksum is compared with the published one), else TrainerError, unless
        `allow_fresh` (train on from these weights anyway, e.g. a deliberate reset)."""
        if self.version > 0 and not allow_fresh:
            published = self._published_checksum()
            mine = state_dict_checksum(_detached(state_dict), self.push_dtype)  # as the PS got it
            check_start(
                self.run_id,
                self.version,
                published == mine,
                f"these weights are not its published version {self.version} (checksum {mine[:12]}, "
                f"published {(published or 'none recorded')[:12]})",
                "start from your checkpoint of that version (with a parameter server, "
                "TrainerClient.published_weights() fetches it), or pass allow_fresh=True to train "
                "on from these weights",
            )
        if self.ps is None:
            return
        latest = self.ps.latest()
        if latest is not None and latest["version"] >= self.version:
            return
        if self.version != 0:
            raise TrainerError(f"the run is at version {self.version} but the PS does not serve it")
        self.ps.commit(0, self.ps.push(_detached(state_dict), 0, dtype=self.push_dtype))

    def _published_checksum(self) -> str | None:
        """The checksum published with the run's current version (None if none was recorded)."""
        latest = self.client.param_versions(self.run_id, 1)
        return latest[0].checksum if latest and latest[0].version == self.version else None

    def published_weights(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The run's current version's weights from the parameter server (checked against the
        published checksum): what a trainer restarted without a checkpoint loads before `start`."""
        if self.ps is None:
            raise TrainerError("no parameter server (ps=...) to fetch the published weights from")
        published = self._published_checksum()
        state_dict, _, _ = self.ps.pull(self.version, device, checksum=published)
        return state_dict

    def next_batch(self, timeout: float | None = None) -> Batch | None:
        """Consume the ready buffer of the current version, waiting up to `timeout` seconds
        (None: for ever); None if it did not become ready in time. Consuming it again (e.g. after
        a crash) returns the same samples with a new consume fence, fencing the earlier consumer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # long-polls of at most poll_s: at least one, even with timeout 0
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out = self.client.consume(
                self.run_id, self.version, wait=self.poll_s if left is None else min(self.poll_s, left)
            )
            if out is not None:
                break
            if left is not None and left <= 0:
                return None
        self._fences[out.version] = out.consume_fence
        return to_batch(out, self.pad_id, self.temperature, self.top_p)

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Publish `version + 1`, trained on buffer `version` (the batch's `version`): push the
        weights to the PS, publish fenced by the consume's fence, then pin the PS's copy to the
        published checksum. Returns the run's new version; TrainerError if fenced."""
        if version not in self._fences:
            raise TrainerError(f"buffer {version} was not consumed by this client (call next_batch first)")
        sd = _detached(state_dict)
        size = sum(t.numel() * cast_dtype(t, self.push_dtype).itemsize for t in sd.values())
        checksum, location = None, None
        if self.ps is not None:
            checksum = self.ps.push(sd, version + 1, dtype=self.push_dtype)
            location = f"ps://{self.ps.addr[0]}:{self.ps.addr[1]}/v{version + 1}"
        new = publish_fenced(
            self.client,
            self.run_id,
            version,
            self._fences.pop(version),
            size_bytes=size,
            checksum=checksum,
            location=location,
        )
        if self.ps is not None and checksum is not None:
            self.ps.commit(version + 1, checksum)
        self.version = new
        return new


def _detached(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in state_dict.items()}
