import pytest

from workers.tasks import arithmetic
from workers.tasks.verifiers import (
    VERIFIERS,
    answers_match,
    as_number,
    bytes_detokenize,
    last_boxed,
    normalize_answer,
    overlong_penalty,
)


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
    assert math(_enc(r"\boxed{41}"), "eos", {"answer": "42"}, bytes_detokenize) == 0.0
    penalty = {"answer": "42", "overlong": {"max": 20, "buffer": 10}}
    assert math(good, "eos", penalty, bytes_detokenize) == 1.0 - 0.5  # 15 tokens: 5 into the buffer
    assert math(good * 3, "length", penalty, bytes_detokenize) == 0.0  # 45 tokens: the whole penalty
    assert math(_enc("x" * 45), "length", penalty, bytes_detokenize) == -1.0  # wrong and overlong


def test_repeat_verifier_rewards_symbol_count_and_stop():
    rep = VERIFIERS["repeat"]
    meta = {"symbol": 7, "count": 3, "eos": 0, "max": 30}
    assert rep([7, 7, 7, 0], "eos", meta, bytes_detokenize) == pytest.approx(1.2)
    assert rep([7, 7, 7, 7, 7], "length", meta, bytes_detokenize) == pytest.approx(1.0 - 2 / 30)
    assert rep([1, 2, 0], "eos", meta, bytes_detokenize) == pytest.approx(-1 / 30)
    assert rep([7, 0], "eos", meta, bytes_detokenize) < rep([7, 7, 0], "eos", meta, bytes_detokenize) < 1.2


@pytest.mark.parametrize(
    "given, expected",
    [
        ("3.0", "3"),
        ("3", "3.000"),
        (" 1 / 2 ", "0.5"),
        (r"\frac{1}{2}", "1/2"),
        (r"\dfrac{-3}{6}", "-0.5"),
        ("-\\frac{1}{2}", "-1/2"),
        ("1,000", "1000"),
        ("2.5e3", "2500"),
        ("9" * 400, "9" * 400),  # huge integers: exact, no float rounding
        ("x^2+1", "x^2 + 1"),  # not a number: equal as normalised text
    ],
)
def test_answers_match_numbers_fractions_and_text(given, expected):
    assert answers_match(given, expected)


@pytest.mark.parametrize(
    "given, expected",
    [
        ("3.01", "3"),
        ("1/3", "0.333"),
        ("9" * 400, "9" * 399 + "8"),  # a float comparison would call these equal
    ],
)
def test_answers_differ(given, expected):
    assert not answers_match(given, expected)


def test_hostile_answers_never_raise():
    assert as_number("1/0") is None and as_number("1e999999999") is None and as_number("1" * 10_000) is None
    assert not answers_match("1" * 10_000, "2")  # over Python's int-digits limit: text only
    assert answers_match("٣", "٣")  # unicode digits: compared as text
    assert not answers_match("٣", "3")


def test_math_verifier_hostile_responses():
    math = VERIFIERS["math"]
    meta = {"answer": "7"}
    assert math(_enc("the answer is 7"), "eos", meta, bytes_detokenize) == 0.0  # no boxed answer
    assert math(_enc(r"\boxed{7"), "length", meta, bytes_detokenize) == 0.0  # cut off inside
    assert math(_enc(r"\boxed{7} no, \boxed{8}"), "eos", meta, bytes_detokenize) == 0.0  # the last counts
    assert math(_enc(r"\boxed{8} no, \boxed{ 7.0 }"), "eos", meta, bytes_detokenize) == 1.0
    nested = {"answer": r"\frac{\sqrt{2}}{2}"}
    assert math(_enc(r"\boxed{\frac{\sqrt{2}}{2}}"), "eos", nested, bytes_detokenize) == 1.0
    assert math(_enc("réponse ✓ \\boxed{7} 🎉"), "eos", meta, bytes_detokenize) == 1.0
    assert math([0xFF, 0xFE, *_enc(r"\boxed{7}"), 300, -1], "eos", meta, bytes_detokenize) == 1.0  # bad bytes, ids
    assert math(_enc("{" * 5000 + r"\boxed{" + "{" * 5000), "length", meta, bytes_detokenize) == 0.0
    assert math([], "eos", {}, bytes_detokenize) == 0.0  # no answer in the metadata: never a match


def test_overlong_penalty_is_linear_in_the_last_tokens():
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == 0.5
    assert overlong_penalty(100, 100, 20) == 1.0
    assert overlong_penalty(500, 100, 20) == 1.0
    assert overlong_penalty(100, 100, 0) == 0.0


def test_arithmetic_data_set_is_reproducible_and_verifiable():
    problems = list(arithmetic.problems(300, seed=3))
    assert problems == list(arithmetic.problems(300, seed=3))
    assert {p["level"] for p in problems} == set(arithmetic.LEVELS)
    assert len({p["id"] for p in problems}) == 300
    for p in problems:
        expr = p["prompt"].removeprefix("Compute ").split(". ")[0]
        assert arithmetic.evaluate(expr) == int(p["answer"])
        response = _enc(f"so the result is \\boxed{{{p['answer']}}}")
        assert VERIFIERS["math"](response, "eos", {"answer": p["answer"]}, bytes_detokenize) == 1.0
    with pytest.raises(ValueError):
        arithmetic.evaluate("__import__('os')")


@pytest.mark.parametrize(
    "given, expected",
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        (r"\frac12", "1/2"),
        (r"\dfrac{2}{4}", "0.5"),
        (r"\sqrt{8}", r"2\sqrt{2}"),
        (r"\{1, 2\}", r"\{2, 1\}"),
        ("x^2 + 2x + 1", "(x+1)^2"),
        ("50\\%", "0.5"),
    ],
)
def test_math_verifier_takes_equivalent_forms(given, expected):
    """math-verify (the `math` extra) decides: forms string matching cannot see as equal."""
    pytest.importorskip("math_verify")
    response = _enc(f"so the answer is \\boxed{{{given}}}")
    assert VERIFIERS["math"](response, "eos", {"answer": expected}, bytes_detokenize) == 1.0


@pytest.mark.parametrize("given, expected", [("0.51", "1/2"), (r"\sqrt{2}", "2"), ("x+1", "(x+1)^2"), ("3", "")])
def test_math_verifier_refuses_different_answers(given, expected):
    pytest.importorskip("math_verify")
    response = _enc(f"\\boxed{{{given}}}")
    assert VERIFIERS["math"](response, "eos", {"answer": expected}, bytes_detokenize) == 0.0


def test_math_verifier_without_math_verify_names_the_extra(monkeypatch):
    import sys

    from workers.extras import MissingExtra
    from workers.reward.worker import verifier_source

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"pip install 'staleflow\[math\]'"):
        verifier_source("math")
    verifier_source("repeat")  # the others need nothing
