"""``staleflow reward-worker``: score finished samples (docs in staleflow_cli/common.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from staleflow_cli.common import API, API_WAIT, RUN, TOKEN, connect, console, fail, hf_folder, on_signals, progress
from workers.client import ApiError

# ---- reward worker ----------------------------------------------------------------------------


def reward_worker(
    run: str = RUN,
    verifier: str = typer.Option(..., "--verifier", help="a verifier of workers/tasks/verifiers.py: repeat, math, ..."),
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    batch: int = typer.Option(256, "--batch", min=1, help="samples claimed per request"),
    claim_seconds: float = typer.Option(60.0, "--claim-seconds", min=1.0, help="seconds a claim is held"),
    model: Path | None = typer.Option(
        None, "--model", help="decode responses with this Hugging Face tokenizer (default: UTF-8 bytes)"
    ),
) -> None:
    """Claim finished samples, score them with a rule-based verifier, post the rewards."""
    from workers.reward.worker import RewardWorker
    from workers.tasks.verifiers import VERIFIERS, bytes_detokenize

    if verifier not in VERIFIERS:
        raise typer.BadParameter(
            f"unknown verifier {verifier!r} (known: {', '.join(sorted(VERIFIERS))})", param_hint="--verifier"
        )
    detokenize = bytes_detokenize
    if model is not None:  # text verifiers (math) read the response as the model wrote it
        hf_folder(model)
        from workers.models.hf import load_tokenizer

        tokenizer = load_tokenizer(model)
        detokenize = lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=True)  # noqa: E731
    client, run_id = connect(api, token, run, api_wait)
    worker = RewardWorker(client, run_id, verifier, detokenize=detokenize, batch=batch, claim_s=claim_seconds)
    on_signals(worker.stop, "posting the rewards in hand")
    with progress(None, f"reward run {run_id}: waiting for samples") as (bar, task):

        def until() -> bool:
            s = worker.stats
            mean = s.reward_sum / s.scored if s.scored else 0.0
            bar.update(
                task,
                description=f"reward run {run_id}: scored {s.scored} (mean {mean:.3f}) "
                f"groups {s.groups_occupied} filtered {s.groups_filtered}",
            )
            return False

        try:
            stats = worker.run(until=until)
        except ApiError as e:
            raise fail(str(e)) from None
    console.print(f"reward worker: {stats.scored} scored")
