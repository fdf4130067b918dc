"""RULER-style synthetic prompts built to a token count of the checkpoint's own tokenizer.

    sample = make_sample("niah_multikey", tokenizer, context_len=8192, seed=3)
    score = score_output(sample, generated_text)  # fraction of sample.answers found in the text

Every prompt is an instruction, a context, the question and an answer prefix, so a model continues with the
answer(s). The context is a haystack of plain-word sentences (words.py) with the needles (the facts the answer
depends on) at random depths, or, for common_words, a list of words. The haystack grows or shrinks by whole
sentences (list entries) until the tokenized prompt is the longest that fits `context_len`. A sample is a pure
function of (task, tokenizer, context_len, seed, chat_template, with_needles). `with_needles=False` gives the
same prompt without the needles (haystack instead), so its answers appear nowhere in it.

`answers` are listed in the order a model states them (the chain order for variable_tracking, the order of
first appearance for common_words, the asked order for niah_multiquery); answer_text() is that continuation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from sparsekv.tasks.ruler.words import ADJECTIVES, ADVERBS, KEYS, LIST_WORDS, NOUNS, VAR_NAMES, VERBS

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                          "variable_tracking", "common_words")

NIAH_DIGITS = 7
NUM_NEEDLES = 4  # multikey: the target and 3 distractors; multivalue: values of the key; multiquery: keys asked
MAX_NEEDLES = 32  # make_sample's `needles` at most (the keys and names are drawn without repeats)
COUNTED_TASKS = ("niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")  # take `needles`
VT_DIGITS = 5
VT_HOPS = 4  # a chain assigns the value to 1 + VT_HOPS variables
VT_CHAINS = 2  # the asked chain and one distractor chain
CW_TOP = 5  # common words to name
CW_RATIO = 10  # a common word appears at least this many times as often as any other

SENTENCES = ("The {adj} {noun} {verb} the {noun2} {adv}.",
             "A {adj} {noun} {verb} a {adj2} {noun2}.",
             "Every {noun} {verb} the {adj} {noun2} near the {noun3}.",
             "Then the {noun} {verb} {adv} and the {noun2} was {adj}.")
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION_ONE = "What is the special magic number for {key} mentioned in the provided text?"
PREFIX_ONE = "The special magic number for {key} mentioned in the provided text is"
QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"
PREFIX_ALL = "The special magic numbers for {key} mentioned in the provided text are"
VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text."
# source before target, so each hop of the chain reads forward from the name just found (docs/decisions.md)
VT_FIRST = "The value {value} is assigned to VAR {name}."
VT_NEXT = "The value of VAR {previous} is assigned to VAR {name}."
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = ("Answer: According to the chain of variable assignments in the text above, {count} variables are "
             "assigned the value {value}, they are:")
CW_INTRO = ("Below is a list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.")
CW_QUESTION = "Question: What are the {count} most common words in the above list?"
CW_PREFIX = "Answer: The top {count} words that appear most often in the list are:"
# Every fixed text a prompt can hold (the probe tokenizer's vocabulary is built from these and words.py).
TEMPLATES: tuple[str, ...] = (*SENTENCES, NIAH_INTRO, NEEDLE, QUESTION_ONE, PREFIX_ONE, QUESTION_ALL, PREFIX_ALL,
                              VT_INTRO, VT_FIRST, VT_NEXT, VT_QUESTION, VT_PREFIX, CW_INTRO, CW_QUESTION, CW_PREFIX,
                              "and")


@dataclass(frozen=True)
class RulerSample:
    task: str
    prompt_ids: list[int]  # the whole prompt, chat template applied when asked
    answers: tuple[str, ...]  # every expected answer string; score = fraction of them found in the output
    max_new_tokens: int  # enough generated tokens to state every answer
    context_tokens: int  # len(prompt_ids)


# A prompt before its haystack is sized: layout(n) is its text with n haystack units, and its answers.
_Layout = Callable[[int], tuple[str, tuple[str, ...]]]


def answer_text(sample: RulerSample) -> str:
    """The continuation that states every answer, as a model trained on these prompts writes it."""
    return " " + ", ".join(sample.answers) + "."


def score_output(sample: RulerSample, output_text: str) -> float:
    """Fraction of sample.answers found in output_text, ignoring whitespace and case."""
    output = _squash(output_text)
    return sum(_squash(answer) in output for answer in sample.answers) / len(sample.answers)


def make_sample(task: str, tokenizer, context_len: int, seed: int, *, chat_template: bool = False,
                with_needles: bool = True, needles: int | None = None) -> RulerSample:
    """`needles` (None: the suite's own counts) sets how many facts a prompt holds, for the tasks of
    COUNTED_TASKS: the needles of niah_multikey, niah_multivalue and niah_multiquery, or the chains of
    variable_tracking, the asked one included. More of them make a harder variant (as RULER's own options do)
    and give a model more key matches per sample."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a RULER task; choose one of {', '.join(TASKS)}")
    if needles is not None and (task not in COUNTED_TASKS or not 2 <= needles <= MAX_NEEDLES):
        fix = (f"give 2 to {MAX_NEEDLES}" if task in COUNTED_TASKS else
               f"only {', '.join(COUNTED_TASKS)} take a count")
        raise ValueError(f"needles={needles} for task {task}: {fix}, or None for the suite's own count")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but this tokenizer has no chat template; pass chat_template=False")
    key = f"ruler:{task}:{context_len}:{seed}" + ("" if needles is None else f":{needles}")
    count = needles or (VT_CHAINS if task == "variable_tracking" else NUM_NEEDLES)
    layout = _LAYOUTS[task](random.Random(key), with_needles, count)

    def encode(n: int) -> list[int]:
        return _encode(tokenizer, layout(n)[0], chat_template)

    # the minimum with needles in both modes, so that both accept the same lengths
    needed = len(_encode(tokenizer, _LAYOUTS[task](random.Random(key), True, count)(0)[0], chat_template))
    if needed > context_len:
        raise ValueError(f"context_len={context_len} is too small for task {task}: its instruction, needles and "
                         f"question alone take {needed} tokens of this tokenizer; use context_len >= {needed}")
    n, prompt_ids = _fit(encode, context_len)
    answers = layout(n)[1]
    answer_ids = tokenizer.encode(" " + ", ".join(answers) + ".", add_special_tokens=False)
    return RulerSample(task=task, prompt_ids=prompt_ids, answers=answers,
                       max_new_tokens=len(answer_ids) + max(4, len(answer_ids) // 4), context_tokens=len(prompt_ids))


def _squash(text: str) -> str:
    return "".join(text.split()).lower()


def _encode(tokenizer, text: str, chat_template: bool) -> list[int]:
    intro_context_question, prefix = text.rsplit("\n", 1)
    if not chat_template:
        return list(tokenizer(text)["input_ids"])
    messages = [{"role": "user", "content": intro_context_question}]
    # enable_thinking=False: templates with a reasoning mode (Qwen3) open the answer directly
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return list(tokenizer(head + prefix, add_special_tokens=False)["input_ids"])


def _fit(encode: Callable[[int], list[int]], target: int) -> tuple[int, list[int]]:
    """(n, encode(n)) for about the largest n whose encoding fits target tokens (the count grows with n)."""
    lo, lo_ids = 0, encode(0)
    hi: int | None = None
    tolerance = max(8, target // 100)
    n = 64
    for _ in range(40):
        ids = encode(n)
        slope = max(0.5, (len(ids) - len(lo_ids)) / (n - lo))
        if len(ids) <= target:
            lo, lo_ids = n, ids
        else:
            hi = n
        if target - len(lo_ids) <= tolerance or (hi is not None and hi - lo <= 1):
            break
        n = lo + max(1, int((target - len(lo_ids)) / slope))
        if hi is not None and n >= hi:
            n = (lo + hi) // 2
    return lo, lo_ids


class _Haystack:
    """An endless, seeded sequence of plain-word sentences; the first n are the same for every n."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.sentences: list[str] = []

    def take(self, n: int) -> list[str]:
        r = self.rng
        while len(self.sentences) < n:
            self.sentences.append(r.choice(SENTENCES).format(
                adj=r.choice(ADJECTIVES), adj2=r.choice(ADJECTIVES), noun=r.choice(NOUNS), noun2=r.choice(NOUNS),
                noun3=r.choice(NOUNS), verb=r.choice(VERBS), adv=r.choice(ADVERBS)))
        return self.sentences[:n]


def _haystack_layout(rng: random.Random, intro: str, inserts: list[tuple[float, str]], question: str,
                     prefix: str, answers: tuple[str, ...]) -> _Layout:
    """Sentences inserted at their depth (fraction of the haystack), shallowest first."""
    haystack = _Haystack(random.Random(rng.random()))
    inserts = sorted(inserts, key=lambda item: item[0])

    def layout(n: int) -> tuple[str, tuple[str, ...]]:
        at: dict[int, list[str]] = {}
        for depth, sentence in inserts:
            at.setdefault(round(depth * n), []).append(sentence)
        parts: list[str] = []
        for i, sentence in enumerate(haystack.take(n) + [""]):
            parts.extend(at.get(i, ()))
            if sentence:
                parts.append(sentence)
        return f"{intro}\n\n{' '.join(parts)}\n\n{question}\n{prefix}", answers

    return layout


def _numbers(rng: random.Random, count: int, digits: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10 ** digits), count)]


def _niah(kind: str) -> Callable[[random.Random, bool, int], _Layout]:
    def layout(rng: random.Random, with_needles: bool, count: int) -> _Layout:
        keys = rng.sample(KEYS, count)
        values = _numbers(rng, count, NIAH_DIGITS)
        depths = [rng.random() for _ in range(count)]
        if kind == "single":
            needles, asked, answers = [(keys[0], values[0])], keys[:1], values[:1]
        elif kind == "multikey":  # needle 0 is asked; the others are distractors with other keys
            needles, asked, answers = list(zip(keys, values)), keys[:1], values[:1]
        elif kind == "multivalue":
            needles, asked, answers = [(keys[0], v) for v in values], keys[:1], values
        else:  # multiquery
            needles, asked, answers = list(zip(keys, values)), keys, values
        inserts = [(d, NEEDLE.format(key=k, value=v)) for d, (k, v) in zip(depths, needles)
                   if with_needles or k not in asked]
        if kind == "multivalue":  # stated in the order they appear
            answers = [v for _, v in sorted(zip(depths, values))]
        if len(asked) == 1:
            question, prefix = ((QUESTION_ALL, PREFIX_ALL) if kind == "multivalue" else (QUESTION_ONE, PREFIX_ONE))
            key_text = asked[0]
        else:
            question, prefix, key_text = QUESTION_ALL, PREFIX_ALL, ", ".join(asked[:-1]) + " and " + asked[-1]
        return _haystack_layout(rng, NIAH_INTRO, inserts, question.format(key=key_text),
                                prefix.format(key=key_text), tuple(answers))

    return layout


def _variable_tracking(rng: random.Random, with_needles: bool, chains: int) -> _Layout:
    names = rng.sample(VAR_NAMES, chains * (VT_HOPS + 1))
    values = _numbers(rng, chains, VT_DIGITS)
    inserts: list[tuple[float, str]] = []
    for c in range(chains):
        chain = names[c * (VT_HOPS + 1):(c + 1) * (VT_HOPS + 1)]
        depths = sorted(rng.random() for _ in chain)
        if c == 0 and not with_needles:
            continue
        inserts.append((depths[0], VT_FIRST.format(name=chain[0], value=values[c])))
        inserts.extend((d, VT_NEXT.format(name=name, previous=prev))
                       for d, name, prev in zip(depths[1:], chain[1:], chain))
    answers = tuple(names[:VT_HOPS + 1])
    question = VT_QUESTION.format(value=values[0])
    prefix = VT_PREFIX.format(count=len(answers), value=values[0])
    return _haystack_layout(rng, VT_INTRO, inserts, question, prefix, answers)


def _common_words(rng: random.Random, with_needles: bool, _: int) -> _Layout:
    pool = list(LIST_WORDS)
    rng.shuffle(pool)
    common, others = pool[:CW_TOP], pool[CW_TOP:]
    order_seed = rng.random()
    question, prefix = CW_QUESTION.format(count=CW_TOP), CW_PREFIX.format(count=CW_TOP)

    def entries(m: int) -> list[str]:
        """About m list entries: each common word CW_RATIO times (or more) as often as any other word."""
        u = max(1, m // (CW_TOP * CW_RATIO + len(others)))
        distinct = min(len(others), max(1, (m - CW_TOP * CW_RATIO * u) // u))
        c = max(CW_RATIO * u, (m - distinct * u) // CW_TOP)
        total = CW_TOP * c + distinct * u
        if with_needles:
            words = [w for w in common for _ in range(c)] + [w for w in others[:distinct] for _ in range(u)]
        else:  # no word stands out and the common ones are absent
            spread = min(len(others), distinct + CW_TOP)
            words = [others[i % spread] for i in range(total)]
        random.Random(order_seed).shuffle(words)
        return words

    def layout(m: int) -> tuple[str, tuple[str, ...]]:
        words = entries(m)
        answers = tuple(sorted(common, key=words.index)) if with_needles else tuple(common)
        return f"{CW_INTRO}\n\n{', '.join(words)}.\n\n{question}\n{prefix}", answers

    return layout


_LAYOUTS: dict[str, Callable[[random.Random, bool, int], _Layout]] = {
    "niah_single": _niah("single"), "niah_multikey": _niah("multikey"), "niah_multivalue": _niah("multivalue"),
    "niah_multiquery": _niah("multiquery"), "variable_tracking": _variable_tracking,
    "common_words": _common_words}
