"""Rule-based verifiers: a reward from (prompt, response, metadata), no model involved.

Each verifier is a plain function `(response_tokens, finish_reason, meta, detokenize) -> float`
registered by name, so a reward worker picks one with `--verifier NAME`. A verifier that needs
an optional package names it in NEEDS, so the worker checks it is installed before claiming.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction

from workers.extras import require

Detokenize = Callable[[Sequence[int]], str]
Verifier = Callable[[Sequence[int], "str | None", dict, Detokenize], float]

VERIFIERS: dict[str, Verifier] = {}
NEEDS: dict[str, str] = {"math": "math_verify"}  # verifier -> the optional module it imports


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


# ASCII digits only: int() would also read other scripts' digits, a surprise in a reward
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$", re.ASCII)
_RATIO = re.compile(r"^(-?\d+)/(-?\d+)$", re.ASCII)
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d{1,3})?$", re.ASCII)


def as_number(ans: str) -> Fraction | None:
    """An exact rational for a plain number, `a/b` or `\\frac{a}{b}` (after normalisation);
    None otherwise. Exact (Fraction, not float) so huge integers compare without rounding;
    the exponent is bounded so a hostile `1e999999999` cannot allocate a giant integer."""
    ans = ans.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+", ans, re.ASCII) else ans  # 1,000 -> 1000
    try:
        if m := _FRAC.match(ans):
            value = Fraction(int(m[2]), int(m[3]))
            return -value if m[1] else value
        if m := _RATIO.match(ans):
            return Fraction(int(m[1]), int(m[2]))
        if _NUMBER.match(ans):
            return Fraction(ans)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(given: str, expected: str) -> bool:
    """Equal after normalisation, or equal as numbers (3.0 == 3, 1/2 == 0.5 == \\frac{1}{2})."""
    a, b = normalize_answer(given), normalize_answer(expected)
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


def overlong_penalty(n_tokens: int, max_tokens: int, cache: int) -> float:
    """DAPO's soft overlong punishment: 0 up to `max_tokens - cache` tokens, then a penalty
    growing linearly to 1 at `max_tokens` (and staying 1 beyond). It tells the policy that
    running out of budget is bad without the cliff of a hard cut-off reward."""
    excess = n_tokens - (max_tokens - cache)
    return 0.0 if excess <= 0 else min(1.0, excess / max(cache, 1))


def equivalent(given: str, expected: str) -> bool:
    """Whether two answers are the same mathematically, by Hugging Face's math-verify (the
    `math` extra): 1/2, 0.5 and \\frac{1}{2} are; so are sets, intervals and expressions
    sympy finds equal. Plain equality (`answers_match`) is tried first: it is exact and fast."""
    if answers_match(given, expected):
        return True
    mv = require("math_verify")
    # math-verify bounds its sympy work with signal.alarm, which only the main thread may set
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"${expected}$", parsing_timeout=limit)
    answer = mv.parse(f"${given}$", parsing_timeout=limit)
    return bool(gold and answer and mv.verify(gold, answer, timeout_seconds=limit))


@register("math")
def math_verifier(tokens: Sequence[int], finish_reason: str | None, meta: dict, detokenize: Detokenize) -> float:
    """1 if the last `\\boxed{...}` answer equals `meta["answer"]` (`equivalent`: by
    math-verify, which the `math` extra installs), else 0. With `meta["overlong"] = {"max": L, "buffer": L_cache}`, minus DAPO's soft
    overlong penalty (`overlong_penalty`): a response in the last L_cache tokens before L
    loses up to 1, linearly."""
    answer = last_boxed(detokenize(tokens))
    expected = str(meta.get("answer", ""))
    reward = 1.0 if answer is not None and expected and equivalent(answer, expected) else 0.0
    overlong = meta.get("overlong")
    if overlong:
        reward -= overlong_penalty(len(tokens), int(overlong["max"]), int(overlong["buffer"]))
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
