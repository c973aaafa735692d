"""Rule-based verifiers: a reward from (prompt, response, metadata), no model involved.

Each verifier is a plain function `(response_tokens, finish_reason, meta, detokenize) -> float`
registered by name, so a reward worker picks one with `--verifier NAME`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]
Verifier = Callable[[Sequence[int], "str | None", dict, Detokenize], float]

VERIFIERS: dict[str, Verifier] = {}


def register(name: str) -> Callable[[Verifier], Verifier]:
    def wrap(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        return fn

    return wrap


def bytes_detokenize(tokens: Sequence[int]) -> str:
    """Byte-level tokens (ids 0..255) back to text; other ids are skipped."""
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_answer(ans: str) -> str:
    ans = ans.strip().replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    ans = ans.rstrip(".").removeprefix("$").removesuffix("$")
    if re.fullmatch(r"-?\d+\.0+", ans):
        ans = ans.split(".")[0]
    return ans


@register("math")
def math_verifier(tokens: Sequence[int], finish_reason: str | None, meta: dict, detokenize: Detokenize) -> float:
    """DAPO-style: +1 if the last boxed answer equals `meta["answer"]` exactly (after
    normalisation), else -1; with `meta["overlong"] = {"max": L, "buffer": Lb}`, responses in
    the last Lb tokens before L lose up to 1 more, linearly (DAPO's soft overlong penalty)."""
    answer = last_boxed(detokenize(tokens))
    correct = answer is not None and normalize_answer(answer) == normalize_answer(str(meta.get("answer", "")))
    reward = 1.0 if correct else -1.0
    overlong = meta.get("overlong")
    if overlong:
        limit, buffer = int(overlong["max"]), int(overlong["buffer"])
        excess = len(tokens) - (limit - buffer)
        if excess > 0:
            reward -= min(1.0, excess / max(buffer, 1))
    return reward


@register("repeat")
def repeat_verifier(tokens: Sequence[int], finish_reason: str | None, meta: dict, detokenize: Detokenize) -> float:
    """The demo task: answer with `meta["symbol"]` exactly `meta["count"]` times, then EOS.

    Partial credit per correct position, a penalty per token of length error (scaled by
    `meta["max"]`, the response budget) and a bonus for stopping exactly: a policy learning
    from scratch first learns to stop, then to copy the symbol, then to count."""
    symbol, count, eos = int(meta["symbol"]), int(meta["count"]), int(meta.get("eos", 0))
    budget = int(meta.get("max", 48))
    body = list(tokens[:-1]) if tokens and tokens[-1] == eos and finish_reason == "eos" else list(tokens)
    hits = sum(1 for t in body[:count] if t == symbol)
    exact = finish_reason == "eos" and len(body) == count
    return hits / count - abs(len(body) - count) / budget + (0.2 if exact else 0.0)


@register("sim")
def sim_verifier(tokens: Sequence[int], finish_reason: str | None, meta: dict, detokenize: Detokenize) -> float:
    """For scale experiments with the `sim` engine: a reward that varies with the length."""
    return (len(tokens) % 7) / 6
