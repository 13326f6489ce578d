"""Templated text families: "counting" and "comparison", five levels each.

counting
    1: a letter in a short common word, asked in one of five ways ("How many times does the
       letter a appear in banana?", "Count the letter a in banana.", ...)
    2: a letter in a made-up string of 5-8 letters over a-e
    3: a letter in a made-up string of 10-16 letters over a-h
    4: the words in a sentence of 4-10 words
    5: a word's occurrences in a sentence of 8-14 words over a six-word vocabulary
comparison
    1: the larger of two distinct two-digit numbers ("Which is larger: 47 or 74?")
    2: the larger or smaller of two three-digit numbers
    3: the largest or smallest of three three-digit numbers
    4: the largest or smallest of four four-digit numbers
    5: the largest or smallest of four five-digit numbers sharing their first three digits

Level 1 solutions are the bare answer; higher levels show the counting or the
comparisons, then "Answer: N". The key is the question text, which holds
everything the answer depends on.
"""

from __future__ import annotations

import random
import string

from stagetrain.tasks.problem import Problem, check_level

MAX_LEVEL = 5
WORDS = (
    "apple", "banana", "cherry", "letter", "little", "happy", "puppy", "coffee", "yellow",
    "summer", "winter", "garden", "paper", "pepper", "mirror", "rabbit", "kitten", "butter",
    "bottle", "balloon", "cookie", "needle", "school", "street", "window", "button", "dinner",
    "bubble", "hello", "sleep", "green", "tree", "three", "cool", "moon", "book", "ball",
    "bell", "doll", "hill", "mama", "papa", "cocoa", "tomato", "potato", "orange", "purple",
    "spoon", "teeth", "sheep", "river", "pizza", "lemon", "honey", "candle", "pillow", "ladder",
    "jelly", "cotton", "carrot", "pebble", "puzzle", "zipper", "hammer", "dragon", "parrot",
    "turtle", "monkey", "donkey", "kettle", "rocket", "forest", "basket", "pencil", "cactus",
    "muffin", "noodle", "banjo", "igloo", "kiwi", "llama", "melon", "nanny", "onion", "queen",
    "robot", "salad", "tiger", "umbrella", "violin", "wagon", "yoyo", "zebra", "guitar",
    "office", "mitten", "goose",
)  # fmt: skip
SENTENCE_WORDS = (
    "the", "a", "cat", "dog", "sat", "ran", "on", "under", "big", "small", "red", "blue",
    "mat", "log", "and", "then", "jumped", "slept", "near", "over", "happy", "old", "tree",
    "house",
)  # fmt: skip
REPEATED_WORDS = ("the", "cat", "dog", "sat", "on", "mat")
LETTER_QUESTIONS = (
    "How many times does the letter {letter} appear in {word}?",
    "How many {letter}'s are in {word}?",
    "Count the letter {letter} in {word}.",
    "In {word}, how many times does {letter} appear?",
    "How often does {letter} occur in the word {word}?",
)
"""Level 1's question forms. With one form, its ~430 (word, letter) problems left 16 in the
held-out split, too few to measure the family by (one standard error 0.075 at 0.9); five
forms leave about a hundred, so that one se is at most 0.05 at any accuracy."""
_MADE_UP = {2: (5, 5, 8), 3: (8, 10, 16)}
"""Level -> (alphabet size, shortest, longest) of the made-up strings."""


def counting(rng: random.Random, level: int) -> Problem:
    """One counting problem of the given level."""
    check_level("counting", level, MAX_LEVEL)
    if level <= 3:
        return _count_letters(rng, level)
    if level == 4:
        words = rng.choices(SENTENCE_WORDS, k=rng.randint(4, 10))
        question = f"How many words are in this sentence: {' '.join(words)}?"
        marks = [f"{w}({i})" for i, w in enumerate(words, 1)]
        return _counted("counting", level, question, len(words), marks)
    words = rng.choices(REPEATED_WORDS, k=rng.randint(8, 14))
    target = rng.choice(REPEATED_WORDS)
    question = f"How many times does the word {target} appear in: {' '.join(words)}?"
    return _counted("counting", level, question, words.count(target), _marks(words, target))


def _count_letters(rng: random.Random, level: int) -> Problem:
    form = LETTER_QUESTIONS[0]
    if level == 1:
        word = rng.choice(WORDS)
        letter = rng.choice(sorted(set(word)))
        form = rng.choice(LETTER_QUESTIONS)
    else:
        letters, shortest, longest = _MADE_UP[level]
        alphabet = string.ascii_lowercase[:letters]
        word = "".join(rng.choices(alphabet, k=rng.randint(shortest, longest)))
        letter = rng.choice(alphabet)
    question = form.format(letter=letter, word=word)
    return _counted("counting", level, question, word.count(letter), _marks(list(word), letter))


def _marks(items: list[str], target: str) -> list[str]:
    """Each item, the matching ones numbered by a running count: 'b, a(1), n, a(2)'."""
    out, seen = [], 0
    for item in items:
        seen += item == target
        out.append(f"{item}({seen})" if item == target else item)
    return out


def _counted(family: str, level: int, question: str, count: int, marks: list[str]) -> Problem:
    solution = str(count) if level == 1 else f"{' '.join(marks)}. Answer: {count}"
    return Problem(
        family=family, level=level, question=question, answer=str(count),
        solution=solution, verifier="numeric", key=question,
    )  # fmt: skip


_SHAPES = {1: (2, 2), 2: (2, 3), 3: (3, 3), 4: (4, 4), 5: (4, 5)}
"""Level -> (how many numbers, how many digits) for comparison levels 2-5."""


def comparison(rng: random.Random, level: int) -> Problem:
    """One comparison problem of the given level."""
    check_level("comparison", level, MAX_LEVEL)
    count, digits = _SHAPES[level]
    if level == 5:
        prefix = rng.randint(100, 999) * 100
        numbers = [prefix + n for n in rng.sample(range(100), count)]
    else:
        numbers = rng.sample(range(10 ** (digits - 1), 10**digits), count)
    largest = level == 1 or rng.random() < 0.5
    best = max(numbers) if largest else min(numbers)
    question = _comparison_question(numbers, largest)
    solution = str(best) if level == 1 else f"{_comparisons(numbers, largest)}. Answer: {best}"
    return Problem(
        family="comparison", level=level, question=question, answer=str(best),
        solution=solution, verifier="numeric", key=question,
    )  # fmt: skip


def _comparison_question(numbers: list[int], largest: bool) -> str:
    if len(numbers) == 2:
        return f"Which is {'larger' if largest else 'smaller'}: {numbers[0]} or {numbers[1]}?"
    listed = ", ".join(str(n) for n in numbers[:-1]) + f" or {numbers[-1]}"
    return f"Which is the {'largest' if largest else 'smallest'}: {listed}?"


def _comparisons(numbers: list[int], largest: bool) -> str:
    """The running winner against each next number: '412 > 397, 455 > 412'."""
    sign, best, steps = (">" if largest else "<"), numbers[0], []
    for n in numbers[1:]:
        winner, loser = (n, best) if (n > best) == largest else (best, n)
        steps.append(f"{winner} {sign} {loser}")
        best = winner
    return ", ".join(steps)
