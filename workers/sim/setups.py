"""Experiment set-ups (docs/policies.md), with the hardware numbers the simulator needs.

Each set-up is a rollout cluster of H20 GPUs (96 GB, 148 dense bf16 TFLOP/s) running one of
the fitted cost models of `cost_models.json`, and a trainer on the rest of a 128-GPU
cluster. Derived numbers (all documented here, none tuned per policy):

* KV capacity (tokens per instance) = (tp·96 GB·0.9 − weights − tp·4 GB activations) /
  KV bytes per token (layers · KV heads · head dim · 2 (K and V) · 2 bytes).
* Prefill rate (tokens/s per instance) = tp·148 TFLOP/s·MFU / (2·active params); MFU 0.5
  dense, 0.3 MoE. Charged for every admission (fresh prompts and re-admitted partials alike:
  new weights invalidate the KV cache, preempted samples are recomputed), with causal attention
  on top: a context of c tokens costs c + attn_coef·c² (`BatchModel`), attn_coef =
  layers·q_heads·head_dim / (2·active params), the dimensions from each model's config.json.
* Weight transfer (docs/policies.md, "Physical fidelity", for the sources): one NIC moves
  8.25 GB/s of weights — verl's checkpoint-engine benchmark measured that for NCCL over
  ConnectX-7 400 Gb/s InfiniBand (Qwen3-30B-A3B to 30 rollout instances in ~7 s).
  * Pull = weight bytes / (tp · 8.25 GB/s) on the wire + 1 s (reload, cache reset). The PS is
    one node with 8 such NICs (an HGX H20 / DGX H100 node's 8 ConnectX-7 ports): it streams at
    most `ps_streams` pulls at full rate and queues the rest, first come first served, so
    instances that pull at the same moment wait for each other (`ps_egress=None`: no limit).
  * The trainer waits while it sends a new version to the PS: weight bytes / 8.25 GB/s (one
    NIC, as verl's measurement), after its step and before the publish.
* Trainer step = 10 s + tokens · 6·active params / (train GPUs · 148 TFLOP/s · MFU), MFU 0.35
  dense, 0.2 MoE, train GPUs = 128 − rollout GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workers.coordinator.cost_model import CostModel, get_cost_model

from .workload import WorkloadShape

GPU_MEMORY = 96e9
GPU_FLOPS = 148e12
MEM_UTIL = 0.9
ACTIVATION_RESERVE = 4e9
NIC_BANDWIDTH = 8.25e9  # bytes/s of weights per NIC (verl checkpoint-engine, NCCL, CX-7 400 Gb/s IB)
PS_NICS = 8  # the PS node's NICs (HGX H20 / DGX H100: 8 ConnectX-7 compute ports)
PULL_OVERHEAD = 1.0
TRAIN_OVERHEAD = 10.0
CLUSTER_GPUS = 128


@dataclass(frozen=True)
class Setup:
    name: str
    model: str  # key in cost_models.json
    parallelism: str
    batch_size: int  # B prompts per step
    group_size: int  # N responses per prompt
    max_response: int  # tokens of one response (multi-turn: of one turn)
    instances: int
    tp: int
    etas: tuple[int, ...]
    params: float  # total parameters
    active_params: float
    layers: int
    kv_heads: int
    q_heads: int  # attention heads (config.json num_attention_heads): d_attn = q_heads·head_dim
    head_dim: int = 128
    moe: bool = False
    max_running: int = 256  # engine's max concurrent sequences (vLLM max_num_seqs)
    train_gpus: int | None = None
    workload: WorkloadShape = field(default_factory=WorkloadShape)
    kv_capacity_override: int | None = None
    prefill_rate_override: float | None = None
    step_time_scale: float = 1.0
    nic_bandwidth: float = NIC_BANDWIDTH  # bytes/s of weights per GPU's NIC
    ps_egress: float | None = PS_NICS * NIC_BANDWIDTH  # bytes/s the PS sends in all; None: no limit
    push_bandwidth: float | None = NIC_BANDWIDTH  # trainer -> PS bytes/s; None: publish at once

    @property
    def cost(self) -> CostModel:
        return get_cost_model(self.model, self.parallelism)

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    @property
    def kv_capacity(self) -> int:
        if self.kv_capacity_override is not None:
            return self.kv_capacity_override
        free = self.tp * GPU_MEMORY * MEM_UTIL - self.weight_bytes - self.tp * ACTIVATION_RESERVE
        return int(free // self.kv_bytes_per_token)

    @property
    def prefill_rate(self) -> float:
        if self.prefill_rate_override is not None:
            return self.prefill_rate_override
        mfu = 0.3 if self.moe else 0.5
        return self.tp * GPU_FLOPS * mfu / (2.0 * self.active_params)

    @property
    def attn_coef(self) -> float:
        """Prefill attention cost per context token squared, in weight-FLOP token-equivalents."""
        return self.layers * self.q_heads * self.head_dim / (2.0 * self.active_params)

    @property
    def pull_transfer_time(self) -> float:
        """Seconds on the wire for one uncontended pull (the instance's tp NICs at full rate)."""
        return self.weight_bytes / (self.tp * self.nic_bandwidth)

    @property
    def pull_time(self) -> float:
        """An uncontended pull: transfer, then reload."""
        return self.pull_transfer_time + PULL_OVERHEAD

    @property
    def ps_streams(self) -> int | None:
        """Pulls the PS serves at once at full rate (None: unlimited)."""
        if self.ps_egress is None:
            return None
        return max(1, int(self.ps_egress // (self.tp * self.nic_bandwidth)))

    @property
    def push_time(self) -> float:
        """The trainer's wait while it sends a version to the PS."""
        return 0.0 if self.push_bandwidth is None else self.weight_bytes / self.push_bandwidth

    @property
    def rollout_gpus(self) -> int:
        return self.instances * self.tp

    @property
    def trainer_gpus(self) -> int:
        return self.train_gpus if self.train_gpus is not None else max(1, CLUSTER_GPUS - self.rollout_gpus)

    @property
    def train_seconds_per_token(self) -> float:
        mfu = 0.2 if self.moe else 0.35
        return self.step_time_scale * 6.0 * self.active_params / (self.trainer_gpus * GPU_FLOPS * mfu)

    def train_step_time(self, tokens: int) -> float:
        return TRAIN_OVERHEAD * self.step_time_scale + tokens * self.train_seconds_per_token

    def scaled(self, **changes) -> Setup:
        """A variant (smaller cluster, batch, ...); `max_response` also rescales the workload."""
        if "max_response" in changes and "workload" not in changes:
            changes["workload"] = self.workload.scaled(changes["max_response"])
        return replace(self, **changes)


def _shape(max_response: int) -> WorkloadShape:
    return WorkloadShape(max_response=max_response)


SETUPS: dict[str, Setup] = {
    "qwen_14b": Setup(
        "qwen_14b",
        "qwen_14b",
        "TP1_PP1",
        batch_size=128,
        group_size=16,
        max_response=20_000,
        instances=32,
        tp=1,
        etas=(1, 2, 3),
        params=14.8e9,
        active_params=14.8e9,
        layers=48,
        kv_heads=8,
        q_heads=40,
        workload=_shape(20_000),
    ),
    "qwen_32b": Setup(
        "qwen_32b",
        "qwen_32b",
        "TP2_PP1",
        batch_size=64,
        group_size=16,
        max_response=20_000,
        instances=16,
        tp=2,
        etas=(1, 2, 3),
        params=32.8e9,
        active_params=32.8e9,
        layers=64,
        kv_heads=8,
        q_heads=40,
        workload=_shape(20_000),
    ),
    "qwen_moe_30b": Setup(
        "qwen_moe_30b",
        "qwen_moe_30b",
        "TP1_PP1",
        batch_size=64,
        group_size=16,
        max_response=20_000,
        instances=32,
        tp=1,
        etas=(1, 2, 3),
        params=30.5e9,
        active_params=3.3e9,
        layers=48,
        kv_heads=4,
        q_heads=32,
        moe=True,
        workload=_shape(20_000),
    ),
    "qwen_7b": Setup(
        "qwen_7b",
        "qwen_7b",
        "TP1_PP1",
        batch_size=64,
        group_size=8,
        max_response=28_000,
        instances=32,
        tp=1,
        etas=(1, 2, 3, 5, 10),
        params=7.6e9,
        active_params=7.6e9,
        layers=28,
        kv_heads=4,
        q_heads=28,
        workload=_shape(28_000),
    ),
}

# Small set-ups for tests and CI-sized runs: same cost model as 7B, few instances.
SETUPS["tiny"] = SETUPS["qwen_7b"].scaled(
    name="tiny",
    batch_size=8,
    group_size=4,
    max_response=4_000,
    instances=4,
    etas=(1, 2),
    kv_capacity_override=60_000,
    train_gpus=8,
    step_time_scale=0.05,
)
SETUPS["small"] = SETUPS["qwen_14b"].scaled(
    name="small",
    batch_size=32,
    group_size=16,
    max_response=8_000,
    instances=8,
    etas=(1, 2, 3),
    train_gpus=48,
)

# 10x the paper's 14B set-up (bench/coordinator.py): 320 instances, B = 1280 prompts of 16
# (~20k samples in flight), the trainer on 10x the paper's 96 GPUs.
SETUPS["qwen_14b_10x"] = SETUPS["qwen_14b"].scaled(
    name="qwen_14b_10x", batch_size=1280, instances=320, train_gpus=10 * (CLUSTER_GPUS - 32)
)

# The simplest physics, without the fidelity costs (20 GB/s per GPU pulls with no PS
# limit, instant publish, prefill linear in the context): `get_setup(name, **LEGACY_PHYSICS)`.
LEGACY_PHYSICS: dict = dict(nic_bandwidth=20e9, ps_egress=None, push_bandwidth=None, q_heads=0)

PAPER_SETUPS = ("qwen_14b", "qwen_32b", "qwen_moe_30b", "qwen_7b")

# Workload shapes beyond the reference four, chosen to break the coordinator's strategies
# (docs/policies.md, "Workload shapes"): each changes one thing of a reference set-up.
SETUPS["short_many"] = SETUPS["qwen_14b"].scaled(  # short answers, many prompts
    name="short_many", batch_size=512, group_size=8, max_response=2_000
)
SETUPS["heavy_tail"] = SETUPS["qwen_14b"].scaled(  # median 1K of 20K, 15% truncated at 20K
    name="heavy_tail", workload=WorkloadShape(max_response=20_000, median_fraction=0.05, truncated_fraction=0.15)
)
SETUPS["correlated"] = SETUPS["qwen_32b"].scaled(  # a group's samples are long or short together
    name="correlated", workload=WorkloadShape(max_response=20_000, group_correlation=0.95)
)
SETUPS["few_instances"] = SETUPS["qwen_moe_30b"].scaled(  # 128 samples per instance per batch
    name="few_instances", instances=8, train_gpus=96
)
SETUPS["many_instances"] = SETUPS["qwen_14b"].scaled(  # 8 samples per instance per batch
    name="many_instances", batch_size=32, group_size=8
)
SETUPS["balanced"] = SETUPS["many_instances"].scaled(  # the trainer's step about as long as the rollout's
    name="balanced", train_gpus=16
)
# Agentic: multi-turn trajectories with tool calls between turns (workload.py): 4 turns on
# average (1 to 8), short answers per turn (median 300 tokens, at most 2K), observations of
# median 300 tokens appended to the context, environment latency of median 1.5 s with a long
# tail (log-spread 1.3: p99 ≈ 30 s, cut at a 60-s timeout); many prompts (256 × 8).
SETUPS["agentic"] = SETUPS["qwen_14b"].scaled(
    name="agentic",
    batch_size=256,
    group_size=8,
    max_response=2_000,
    workload=WorkloadShape(
        max_response=2_000,
        median_fraction=0.15,
        max_turns=8,
        mean_turns=4.0,
        obs_median=300,
        env_median=1.5,
        env_sigma=1.3,
        env_timeout=60.0,
    ),
)
SHAPE_SETUPS = ("short_many", "heavy_tail", "correlated", "few_instances", "many_instances", "balanced", "agentic")


def get_setup(name: str | Setup, **changes) -> Setup:
    if isinstance(name, Setup):
        return name.scaled(**changes) if changes else name
    if name not in SETUPS:
        raise KeyError(f"unknown set-up {name!r}; known: {', '.join(SETUPS)}")
    s = SETUPS[name]
    return s.scaled(**changes) if changes else s
