"""``staleflow reward-worker``: score finished samples (docs in staleflow_cli/common.py and
docs/integration.md#your-reward)."""

from __future__ import annotations

from pathlib import Path

import typer

from staleflow_cli.common import (
    API,
    API_WAIT,
    ENV_CODEC,
    RUN,
    TOKEN,
    connect,
    console,
    fail,
    hf_folder,
    on_signals,
    progress,
)
from workers.client import ApiError

# ---- reward worker ----------------------------------------------------------------------------


def reward_worker(
    run: str = RUN,
    verifier: str | None = typer.Option(
        None, "--verifier", help="a verifier of workers/tasks/verifiers.py: repeat, math (the `math` extra), sim"
    ),
    reward: str | None = typer.Option(
        None,
        "--reward",
        help="your reward function, module:function (imported from PYTHONPATH): takes a sample, "
        "returns a number or {'reward': x, 'metrics': {...}}; sync or async",
    ),
    reward_batch: bool = typer.Option(
        False, "--reward-batch", help="--reward's function takes a list of samples and returns a list of rewards"
    ),
    env: str | None = typer.Option(
        None,
        "--env",
        help="a multi-turn environment, module:ClassOrFactory: the reward is the sum of its rewards, "
        "the trajectory's turns replayed through it (as `rollout-worker --env`)",
    ),
    codec: str | None = ENV_CODEC,
    reward_url: str | None = typer.Option(
        None, "--reward-url", help="a reward service: POST URL with the samples as JSON (docs/integration.md)"
    ),
    reward_header: list[str] | None = typer.Option(
        None, "--reward-header", help="'Name: value' sent to --reward-url with every request (repeatable)"
    ),
    concurrency: int = typer.Option(
        8, "--reward-concurrency", min=1, max=1024, help="calls of --reward, or requests to --reward-url, at a time"
    ),
    request_size: int = typer.Option(16, "--reward-request-size", min=1, help="samples per --reward-url request"),
    timeout: float = typer.Option(
        30.0, "--reward-timeout", min=0.01, help="seconds one call (one sample, one batch, one request) may take"
    ),
    retries: int = typer.Option(
        2, "--reward-retries", min=0, max=100, help="tries after a failed one; then the sample is dropped"
    ),
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    batch: int = typer.Option(256, "--batch", min=1, help="samples claimed per request"),
    claim_seconds: float = typer.Option(60.0, "--claim-seconds", min=1.0, help="seconds a claim is held"),
    linger: float | None = typer.Option(
        None,
        "--linger",
        min=0.0,
        max=60.0,
        help="seconds after a claim that took fewer than --batch samples before the next claim, so "
        "samples come a few per claim (default 0.25; 0: claim again at once)",
    ),
    model: Path | None = typer.Option(
        None, "--model", help="decode prompts and responses with this Hugging Face tokenizer (default: UTF-8 bytes)"
    ),
) -> None:
    """Claim finished samples, score them (a verifier, your function or a reward service), post
    the rewards; a reward that keeps failing drops its sample as reward_failed."""
    from workers.extras import MissingExtra
    from workers.retry import REWARD_CALL
    from workers.reward.sources import FunctionReward, HttpReward, RewardSource, load_function
    from workers.reward.worker import RewardWorker, verifier_source
    from workers.tasks.verifiers import bytes_detokenize

    chosen = [
        o
        for o, v in (("--verifier", verifier), ("--reward", reward), ("--reward-url", reward_url), ("--env", env))
        if v
    ]
    if len(chosen) != 1:
        raise typer.BadParameter(
            "give exactly one of --verifier, --reward, --reward-url, --env", param_hint="--verifier"
        )
    if reward_batch and not reward:
        raise typer.BadParameter("--reward-batch goes with --reward", param_hint="--reward-batch")
    detokenize = bytes_detokenize
    if model is not None:  # text rewards (math, yours) read the response as the model wrote it
        hf_folder(model)
        from workers.models.hf import load_tokenizer

        tokenizer = load_tokenizer(model)
        detokenize = lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=True)  # noqa: E731
    source: RewardSource
    if verifier:
        try:
            source = verifier_source(verifier, detokenize)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--verifier") from None
        except MissingExtra as e:
            raise fail(f"--verifier {verifier}: {e}") from None
    elif env:
        from workers.envs.base import load_codec, load_env
        from workers.envs.reward import EnvReward

        try:
            source = EnvReward(load_env(env), load_codec(codec), name=env, timeout_s=timeout)
        except Exception as e:  # the user's module may fail to import in any way
            raise typer.BadParameter(f"{env}: {type(e).__name__}: {e}", param_hint="--env") from None
    elif reward:
        try:
            fn = load_function(reward)
        except Exception as e:  # the user's module may fail to import in any way
            raise typer.BadParameter(f"{reward}: {type(e).__name__}: {e}", param_hint="--reward") from None
        source = FunctionReward(fn, batch=reward_batch, concurrency=concurrency, name=reward)
    else:
        assert reward_url is not None
        if not reward_url.startswith(("http://", "https://")):
            raise typer.BadParameter("an http:// or https:// URL", param_hint="--reward-url")
        headers = {}
        for h in reward_header or []:
            name, sep, value = h.partition(":")
            if not sep or not name.strip():
                raise typer.BadParameter(f"{h!r}: 'Name: value'", param_hint="--reward-header")
            headers[name.strip()] = value.strip()
        source = HttpReward(reward_url, concurrency=concurrency, request_size=request_size, headers=headers)
    if timeout * (retries + 1) > claim_seconds:
        console.print(
            f"[yellow]warning:[/yellow] {retries + 1} tries of {timeout:g} s may outlast the {claim_seconds:g} s claim "
            "(--claim-seconds): a claim that expires is scored again by a worker"
        )
    client, run_id = connect(api, token, run, api_wait)
    worker = RewardWorker(
        client,
        run_id,
        source,
        detokenize=detokenize,
        batch=batch,
        claim_s=claim_seconds,
        timeout_s=timeout,
        retry=REWARD_CALL.but(attempts=retries + 1),
        **({} if linger is None else {"linger_s": linger}),
    )
    on_signals(worker.stop, "posting the rewards in hand")
    with progress(None, f"reward run {run_id} ({source.description}): waiting for samples") as (bar, task):

        def until() -> bool:
            s = worker.stats
            mean = s.reward_sum / s.scored if s.scored else 0.0
            bar.update(
                task,
                description=f"reward run {run_id}: scored {s.scored} (mean {mean:.3f}) dropped {s.dropped} "
                f"groups {s.groups_occupied} filtered {s.groups_filtered}",
            )
            return False

        try:
            stats = worker.run(until=until)
        except ApiError as e:
            raise fail(str(e)) from None
    console.print(f"reward worker: {stats.scored} scored, {stats.dropped} dropped (reward_failed)")
