"""Train a Hugging Face causal LM through StaleFlow with TRL's GRPOTrainer.

A TRL GRPO script, changed in three places: `StaleFlowGRPOTrainer` instead of `GRPOTrainer`,
a `TrainerClient` for the run instead of `reward_funcs` and `train_dataset` (StaleFlow's
rollout workers generate, its reward workers score), and `max_steps` = the buffers to train.
TRL computes the loss (DAPO by default, clipped against the generating policy's log-probs) and
steps the optimizer; each step's weights are published to the rollout workers through the
parameter server, so generation runs ahead asynchronously, at most the run's η versions behind.

    python docs/examples/train_trl.py --run 1 --model ./my-model --ps 127.0.0.1:29600 --steps 100

The token (role `trainer`) comes from --token or STALEFLOW_TOKEN; --api from STALEFLOW_API_URL.
The rollout workers must run the same folder (`staleflow rollout-worker --engine hf --model`);
TRL's temperature is the run's sampling temperature (the adapter refuses a batch sampled at
another). Needs the `trl` extra.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoTokenizer
from trl import GRPOConfig

from workers.sdk import TrainerClient
from workers.trainer.trl_adapter import StaleFlowGRPOTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=int, required=True)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--api", default=os.environ.get("STALEFLOW_API_URL") or None)
    ap.add_argument("--token", default=os.environ.get("STALEFLOW_TOKEN") or None)
    ap.add_argument("--ps", default=None, help="HOST:PORT of `staleflow ps` (where rollout workers pull weights)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a batch")
    ap.add_argument("--out", default=None, help="TRL's output_dir (default: a temporary folder)")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    gpu = torch.cuda.is_available()
    with TrainerClient(args.api, args.token, args.run, ps=args.ps, pad_id=tokenizer.pad_token_id or 0) as sf:
        config = GRPOConfig(
            output_dir=args.out or tempfile.mkdtemp(prefix="trl-"),
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            temperature=sf.temperature,  # the run's: the rollout's log-probs are of logits / T
            bf16=gpu,
            use_cpu=not gpu,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = StaleFlowGRPOTrainer(
            args.model, sf, args=config, processing_class=tokenizer, batch_timeout=args.timeout
        )
        trainer.train()


if __name__ == "__main__":
    main()
