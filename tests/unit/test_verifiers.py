import pytest

from workers.tasks.verifiers import VERIFIERS, bytes_detokenize, last_boxed, normalize_answer


def _enc(text):
    return list(text.encode())


def test_last_boxed_balances_braces():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed(r"\boxed{unclosed") is None
    assert normalize_answer(" 3.00 ") == "3" and normalize_answer(r"\dfrac{1}{2}") == r"\frac{1}{2}"


def test_math_verifier_exact_match_and_overlong_penalty():
    math = VERIFIERS["math"]
    good = _enc(r"thus \boxed{42}")
    assert math(good, "eos", {"answer": "42"}, bytes_detokenize) == 1.0
    assert math(_enc(r"\boxed{41}"), "eos", {"answer": "42"}, bytes_detokenize) == -1.0
    penalty = {"answer": "42", "overlong": {"max": 20, "buffer": 10}}
    assert math(good, "eos", penalty, bytes_detokenize) == 1.0 - 0.5  # 15 tokens: 5 into the buffer
    assert math(good * 3, "length", penalty, bytes_detokenize) == 0.0  # 45 tokens: the whole penalty


def test_repeat_verifier_rewards_symbol_count_and_stop():
    rep = VERIFIERS["repeat"]
    meta = {"symbol": 7, "count": 3, "eos": 0, "max": 30}
    assert rep([7, 7, 7, 0], "eos", meta, bytes_detokenize) == pytest.approx(1.2)
    assert rep([7, 7, 7, 7, 7], "length", meta, bytes_detokenize) == pytest.approx(1.0 - 2 / 30)
    assert rep([1, 2, 0], "eos", meta, bytes_detokenize) == pytest.approx(-1 / 30)
    assert rep([7, 0], "eos", meta, bytes_detokenize) < rep([7, 7, 0], "eos", meta, bytes_detokenize) < 1.2
