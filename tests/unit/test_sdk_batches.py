"""workers.sdk.to_batch: the API's batch as right-padded tensors, aligned per position."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from workers.sdk import TrainerError, to_batch
from workers.wire.models import BatchOut


def _sample(sid, tokens, v_traj, reward, mask=None):
    return {
        "loss_mask": mask or [1] * len(tokens),
        "sample_id": sid,
        "idx": 0,
        "v_traj": v_traj,
        "tokens": tokens,
        "logprobs": [-0.5 * (i + 1) for i in range(len(tokens))],
        "reward": reward,
        "finish_reason": "eos",
        "segments": [],
    }


def _batch(**over):
    groups = [
        {"group_id": 7, "group_version": 3, "prompt_tokens": [1, 2], "meta": {"answer": "4"},
         "samples": [_sample(1, [5, 6, 0], 3, 1.0), _sample(2, [9], 4, 0.0)]},
        {"group_id": 8, "group_version": 4, "prompt_tokens": [1, 2, 3, 4], "meta": {},
         "samples": [_sample(3, [5], 4, 0.5)]},
    ]  # fmt: skip
    return BatchOut.model_validate({"run_id": 1, "version": 4, "consume_fence": 2, "groups": groups, **over})


def test_to_batch_pads_and_aligns_every_field():
    b = to_batch(_batch(), pad_id=99)
    assert len(b) == 3 and b.version == 4 and b.consume_fence == 2
    assert b.input_ids.tolist() == [[1, 2, 5, 6, 0], [1, 2, 9, 99, 99], [1, 2, 3, 4, 5]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]]
    assert b.logprobs.tolist() == [[0, 0, -0.5, -1.0, -1.5], [0, 0, -0.5, 0, 0], [0, 0, 0, 0, -0.5]]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert b.versions.tolist() == [3, 4, 4] and b.staleness.tolist() == [1, 0, 0]
    assert b.group_ids.tolist() == [7, 7, 8] and b.prompt_lengths.tolist() == [2, 2, 4]
    assert b.meta[0] == {"answer": "4"} and b.input_ids.dtype == torch.long


def test_to_batch_refuses_misaligned_logprobs():
    out = _batch()
    out.groups[0].samples[0].logprobs.pop()
    with pytest.raises(TrainerError, match="sample 1: 3 tokens but 2 log-probs"):
        to_batch(out)


def test_to_batch_masks_an_environments_observations_out_of_the_loss():
    """A multi-turn sample: turn [5], observation [40, 41], turn [6, 0]: only turns train."""
    groups = [
        {"group_id": 7, "group_version": 3, "prompt_tokens": [1, 2], "meta": {},
         "samples": [_sample(1, [5, 40, 41, 6, 0], 3, 1.0, mask=[1, 0, 0, 1, 1])]},
    ]  # fmt: skip
    b = to_batch(BatchOut.model_validate({"run_id": 1, "version": 4, "consume_fence": 2, "groups": groups}))
    assert b.response_mask.tolist() == [[0, 0, 1, 0, 0, 1, 1]]
