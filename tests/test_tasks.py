"""Task problems: generation, correctness, difficulty, splits, verification (files: test_task_families)."""

from __future__ import annotations

import ast
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stagetrain.errors import StageError
from stagetrain.tasks import (
    FAMILIES,
    VERIFIERS,
    Family,
    Problem,
    arithmetic,
    extract_answer,
    normalise,
    problems,
    prompt,
    sample,
    score,
    split_of,
    text,
    training_text,
)
from stagetrain.tasks.text import LETTER_QUESTIONS, WORDS

ALL = list(FAMILIES)
LEVELS = [1, 2, 3, 4, 5]


def _draw(family: str, level: int, n: int = 400, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    return [FAMILIES[family].generate(rng, level) for _ in range(n)]


def _problem(answer: str = "46", verifier: str = "numeric") -> Problem:
    return Problem(
        family="t",
        level=1,
        question="q",
        answer=answer,
        solution=answer,
        verifier=verifier,
        key="q",
    )


# formats


def test_prompt_and_training_text_are_exact() -> None:
    p = Problem(
        family="arithmetic", level=4, question="3*4+5", answer="17",
        solution="3*4=12, 12+5=17. Answer: 17", verifier="numeric", key="3*4+5",
    )  # fmt: skip
    assert prompt(p) == "<|problem|>3*4+5<|answer|>"
    assert training_text(p) == "<|problem|>3*4+5<|answer|>3*4=12, 12+5=17. Answer: 17"
    assert _draw("arithmetic", 1, 1)[0].solution == _draw("arithmetic", 1, 1)[0].answer


def test_generated_solutions_match_the_documented_shapes() -> None:
    assert [p.solution for p in _draw("arithmetic", 4, 2, seed=1)] == [
        "5*17=85, 10+85=95. Answer: 95",
        "14*8=112, 112-5=107. Answer: 107",
    ]
    p = _draw("comparison", 3, 1, seed=2)[0]
    assert p.question == "Which is the largest: 983, 969 or 157?"
    assert p.solution == "983 > 969, 983 > 157. Answer: 983"


# reproducibility


def test_problems_are_reproducible_for_a_seed_and_differ_for_another() -> None:
    random.seed(0)
    first = problems(ALL, LEVELS, "train", 200, seed=7)
    random.seed(1)  # the global generator must not matter
    again = problems(ALL, LEVELS, "train", 200, seed=7)
    other = problems(ALL, LEVELS, "train", 200, seed=8)
    assert first == again
    assert len(first) == 200
    assert sum(a.key != b.key for a, b in zip(first, other, strict=True)) > 150
    assert {(p.family, p.level) for p in first} == {(f, lv) for f in ALL for lv in LEVELS}
    assert [p.key for p in _draw("counting", 3, 20, seed=5)] == [
        p.key for p in _draw("counting", 3, 20, seed=5)
    ]


# correctness


@pytest.mark.parametrize("level", LEVELS)
def test_arithmetic_answers_are_correct(level: int) -> None:
    for p in _draw("arithmetic", level, 1000, seed=level):
        assert p.key == p.question
        assert int(p.answer) == eval(p.question), p
        assert p.solution.endswith(p.answer)
        if level >= 4:
            steps, answer = p.solution.split(". Answer: ")
            assert answer == p.answer
            for step in steps.split(", "):
                lhs, rhs = step.rsplit("=", 1)
                assert eval(lhs) == int(rhs), p
            assert int(steps.rsplit("=", 1)[1]) == int(p.answer)


def test_arithmetic_subtraction_never_goes_negative_below_level_4() -> None:
    for level in (1, 2, 3):
        assert min(int(p.answer) for p in _draw("arithmetic", level, 2000)) >= 0


def test_level5_parentheses_change_the_value() -> None:
    for p in _draw("arithmetic", 5, 500):
        assert p.question.count("(") == p.question.count(")") == 1
        assert eval(p.question) != eval(p.question.replace("(", "").replace(")", "")), p


def test_arithmetic_never_calls_eval() -> None:
    tree = ast.parse(Path(arithmetic.__file__).read_text())
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "evaluate" in called
    assert not called & {"eval", "exec", "compile"}


LETTER_FORMS = [
    re.escape(form).replace(r"\{letter\}", r"(?P<letter>\w)").replace(r"\{word\}", r"(?P<word>\w+)")
    for form in LETTER_QUESTIONS
]  # fmt: skip


def test_counting_level_1_holds_out_enough_problems_to_measure() -> None:
    """One standard error of a held-out accuracy at most 0.05 at any accuracy needs 100
    distinct held-out problems (0.25 / 0.05^2)."""
    questions = {
        f.format(letter=c, word=w) for w in WORDS for c in set(w) for f in LETTER_QUESTIONS
    }
    assert sum(split_of(q) == "test" for q in questions) >= 100
    drawn = {p.question for p in problems(["counting"], [1], "test", 2000, seed=3)}
    assert len(drawn) >= 100
    used = {i for q in drawn for i, form in enumerate(LETTER_FORMS) if re.fullmatch(form, q)}
    assert used == set(range(len(LETTER_QUESTIONS)))


@pytest.mark.parametrize("level", LEVELS)
def test_counting_answers_are_correct(level: int) -> None:
    for p in _draw("counting", level, 500, seed=level):
        q = p.question
        letter = next((m for form in LETTER_FORMS if (m := re.fullmatch(form, q))), None)
        if letter:
            expected = letter["word"].count(letter["letter"])
        elif m := re.fullmatch(r"How many words are in this sentence: ([\w ]+)\?", q):
            expected = len(m[1].split())
        else:
            m = re.fullmatch(r"How many times does the word (\w+) appear in: ([\w ]+)\?", q)
            assert m, q
            expected = m[2].split().count(m[1])
        assert p.answer == str(expected), p
        assert p.solution.endswith(f"Answer: {expected}") or p.solution == str(expected)


@pytest.mark.parametrize("level", LEVELS)
def test_comparison_answers_are_correct(level: int) -> None:
    for p in _draw("comparison", level, 500, seed=level):
        numbers = [int(n) for n in re.findall(r"\d+", p.question)]
        assert len(set(numbers)) == len(numbers)
        larger = re.search(r"larger|largest", p.question) is not None
        assert p.answer == str(max(numbers) if larger else min(numbers)), p
        if level > 1:
            steps, answer = p.solution.split(". Answer: ")
            pairs = [re.fullmatch(r"(\d+) ([<>]) (\d+)", s) for s in steps.split(", ")]
            assert len(pairs) == len(numbers) - 1
            for m in pairs:
                assert m and m[2] == (">" if larger else "<")
                assert (int(m[1]) > int(m[3])) == larger
            assert pairs[-1][1] == answer == p.answer


# difficulty


def _operands(question: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", question)]


def test_arithmetic_levels_get_harder() -> None:
    one, two, three, four, five = (_draw("arithmetic", lv, 500) for lv in LEVELS)
    assert all(re.fullmatch(r"\d\d\+\d\d", p.question) for p in one)
    assert all(re.fullmatch(r"\d{3}[-+]\d{3}", p.question) for p in two)
    assert {"+", "-"} <= {p.question[3] for p in two}
    products = [p for p in three if "*" in p.question]
    assert 150 < len(products) < 350
    assert all(sorted(len(str(n)) for n in _operands(p.question)) == [1, 2] for p in products)
    assert all(len(_operands(p.question)) == 3 and "*" in p.question for p in four)
    assert all(len(_operands(p.question)) == 4 for p in five)
    assert max(int(p.answer) for p in one) < max(int(p.answer) for p in two)


def test_text_levels_get_harder() -> None:
    def subject_length(p: Problem) -> int:
        return len(p.question.rsplit(" ", 1)[1].rstrip("?"))

    counting = [_draw("counting", lv, 300) for lv in (1, 2, 3)]
    means = [sum(map(subject_length, ps)) / len(ps) for ps in counting]
    assert means[0] < means[1] < means[2]
    shapes = []
    for level in LEVELS:
        ps = _draw("comparison", level, 300)
        shapes.append((max(len(_operands(p.question)) for p in ps), max(len(p.answer) for p in ps)))
    assert shapes == [(2, 2), (2, 3), (3, 3), (4, 4), (4, 5)]
    assert {"smallest", "largest"} == {
        re.findall(r"smallest|largest", p.question)[0] for p in _draw("comparison", 4, 50)
    }


# splits


@pytest.mark.parametrize("family", ALL)
def test_splits_are_disjoint_and_stable(family: str) -> None:
    for level in LEVELS:
        keys = {}
        for split, n in (("train", 2000), ("val", 400), ("test", 400)):
            drawn = problems([family], [level], split, n, seed=level)
            assert all(split_of(p.key) == split for p in drawn)
            assert all(p.family == family and p.level == level for p in drawn)
            keys[split] = {p.key for p in drawn}
        assert not keys["train"] & keys["val"]
        assert not keys["train"] & keys["test"]
        assert not keys["val"] & keys["test"]


SPLITS_OF = "from stagetrain.tasks import split_of; print(' '.join(split_of(k) for k in {keys!r}))"


def test_split_of_is_a_fixed_function_of_the_key() -> None:
    """The same in every process whatever its hash seed (Python's `hash` of a str is not), and
    the values it had, so held-out problems stay held out across runs and versions."""
    keys = ["12+34", "10+15", "10+19", *(f"What is {i} doubled?" for i in range(200))]
    here = [split_of(k) for k in keys]
    assert here[:3] == ["train", "test", "val"]
    for seed in ("0", "1"):
        there = subprocess.run([sys.executable, "-c", SPLITS_OF.format(keys=keys)], capture_output=True, text=True,
                               check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()  # fmt: skip
        assert there == here


def test_level1_addition_holds_about_five_percent_out() -> None:
    keys = [f"{a}+{b}" for a in range(10, 100) for b in range(10, 100)]
    assert len(keys) == 8100
    test = [k for k in keys if split_of(k) == "test"]
    val = [k for k in keys if split_of(k) == "val"]
    assert 330 < len(test) < 480
    assert 330 < len(val) < 480
    assert len(test) == 431  # fixed by sha256; a change here reshuffles every split
    drawn = {p.key for p in problems(["arithmetic"], [1], "test", 3000, seed=0)}
    assert drawn <= set(test)
    assert len(drawn) > 0.9 * len(test)


def test_sample_rejects_unknown_family_level_and_split() -> None:
    rng = random.Random(0)
    with pytest.raises(
        StageError, match=r"unknown family 'algebra'.*arithmetic, comparison, counting"
    ):
        sample("algebra", 1, "train", rng)
    with pytest.raises(StageError, match=r"'arithmetic' has levels 1\.\.5, not 6"):
        sample("arithmetic", 6, "train", rng)
    with pytest.raises(StageError, match=r"'counting' has levels 1\.\.5, not 0"):
        sample("counting", 0, "test", rng)
    with pytest.raises(StageError, match=r"unknown split 'dev'"):
        sample("counting", 1, "dev", rng)  # type: ignore[arg-type]
    with pytest.raises(StageError, match="unknown family 'algebra'"):
        problems(["arithmetic", "algebra"], [1], "train", 5, seed=0)
    with pytest.raises(StageError, match="not 9"):
        problems(["comparison"], [1, 9], "train", 5, seed=0)
    with pytest.raises(StageError, match="at least one family"):
        problems([], [1], "train", 5, seed=0)


def test_sample_gives_up_when_a_split_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    only = Problem(family="one", level=1, question="12+34", answer="46", solution="46", key="12+34")
    assert split_of(only.key) == "train"
    monkeypatch.setitem(
        FAMILIES, "one", Family(name="one", max_level=1, generate=lambda rng, level: only)
    )
    assert sample("one", 1, "train", random.Random(0)) == only
    with pytest.raises(StageError, match="no test problem of family 'one' level 1"):
        sample("one", 1, "test", random.Random(0))


# verification


def test_score_accepts_the_answer_in_its_usual_forms() -> None:
    p = _problem("46")
    for completion in (
        "46", " 46 ", "46<|eos|>", "I think it is 46.", "12+34=46", "046",
        "Let me add. 12+34=46. Answer: 46", "answer: 46", "Answer: 46<|eos|>Answer: 47",
        "46<|problem|>1+1<|answer|>2", "Answer: 40\nAnswer: 46\nthat is 12 more",
    ):  # fmt: skip
        assert score(completion, p) == 1.0, completion
    for completion in ("47", "Answer: 47", "Answer: 47\n46", "4 6", "46.5", "", "Answer:"):
        assert score(completion, p) == 0.0, completion


def test_score_handles_separators_and_negatives() -> None:
    assert score("Answer: 1,234", _problem("1234")) == 1.0
    assert score("that makes 1,234.", _problem("1234")) == 1.0
    assert score("Answer: 1234", _problem("1,234")) == 1.0
    assert score("2*19=38, 2-38=-36. Answer: -36", _problem("-36")) == 1.0
    assert score("Answer: 36", _problem("-36")) == 0.0
    assert score("Answer: -36", _problem("36")) == 0.0
    assert score("10-3", _problem("3")) == 1.0  # '-' after a digit is an operator, not a sign
    assert score("Answer: -0", _problem("0")) == 1.0


def test_normalise_and_verifiers() -> None:
    assert normalise("  +46. ") == "46"
    assert normalise("(-5)") == "-5"
    assert normalise("-0") == "0"
    assert normalise("1,234,567") == "1234567"
    assert normalise("**Hello   World!**") == "hello world"
    assert normalise("12,34") == "12,34"
    assert VERIFIERS["numeric"]("046", "46") == 1.0
    assert VERIFIERS["exact"]("046", "46") == 0.0
    assert VERIFIERS["exact"]("Paris.", "paris") == 1.0
    assert VERIFIERS["numeric"]("1" + "0" * 5000, "1" + "0" * 5000) == 1.0  # past int()'s digit cap


def test_extract_answer() -> None:
    assert extract_answer("I think it is 46.") == "46"
    assert extract_answer("no digits here") is None
    assert extract_answer("") is None
    assert extract_answer("Answer: Paris\nmore", numeric=False) == "Paris"
    assert (
        extract_answer("The capital is Paris<|eos|>junk", numeric=False) == "The capital is Paris"
    )
    assert extract_answer("   <|eos|>Paris", numeric=False) is None
    assert score("Answer: paris.", _problem("Paris", "exact")) == 1.0


def test_score_never_raises_on_garbage() -> None:
    p = _problem("123456789")
    rng = random.Random(0)
    for _ in range(3000):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(300))).decode(errors="replace")
        assert score(junk, p) == 0.0
        assert score(junk + "\nAnswer: 123456789", p) == 1.0
    for bad in (None, 46, b"46", ["46"], "\ud800", "9" * 100_000, "Answer: " + "4" * 50_000):
        assert score(bad, p) == 0.0  # type: ignore[arg-type]
    assert score("x" * 1_000_000 + " 123456789", p) == 1.0
    assert score("46", _problem("46", verifier="no-such-verifier")) == 0.0


def test_a_problem_the_reward_cannot_read_scores_zero_rather_than_raising() -> None:
    from types import SimpleNamespace

    unreadable = SimpleNamespace(verifier="exact", answer=None)  # normalise(None) raises inside
    assert score("Answer: 46", unreadable) == 0.0  # type: ignore[arg-type]


def test_only_the_first_end_marker_and_the_answers_first_line_bound_the_answer() -> None:
    assert extract_answer("Answer: 1<|eos|>Answer: 2<|eos|>Answer: 3") == "1"
    assert extract_answer("Answer: Paris\nmore\nlines", numeric=False) == "Paris"
    assert extract_answer("Answer: New York\nmore", numeric=False) == "New York"
    # Without an "Answer:" the whole text is read, every line of it.
    assert extract_answer("first 3\nthen 46") == "46"


def test_a_sign_survives_normalising_only_before_a_digit() -> None:
    assert normalise("-yes") == "yes"
    assert normalise("--5") == "5"
    assert normalise("-7") == "-7"


def test_numeric_answers_compare_as_integers_zero_unsigned_and_other_answers_exactly() -> None:
    assert VERIFIERS["numeric"]("-0.0", "0") == 1.0
    assert VERIFIERS["numeric"]("-00.00", "0") == 1.0
    assert VERIFIERS["numeric"]("007", "7") == 1.0
    assert VERIFIERS["numeric"]("-7", "7") == 0.0
    assert VERIFIERS["numeric"]("Paris", "paris.") == 1.0  # neither is an integer: exact


def test_text_module_exposes_max_level() -> None:
    assert text.MAX_LEVEL == arithmetic.MAX_LEVEL == 5
    assert {f.max_level for f in FAMILIES.values()} == {5}
