"""RULER's synthetic tasks as token-id generators of an exact length.

The task definitions (needles, chains, word lists, counts, wording of the instruction, question and
answer prefix) follow RULER (github.com/NVIDIA/RULER, ``scripts/data/synthetic/`` and
``scripts/synthetic.yaml``); the code is ours. Where RULER sizes a text by binary search over
words and re-tokenises, we tokenise each part once and concatenate ids, so a body is exactly the
tokens it needs (list tasks pad the few tokens left with line breaks). Differences from RULER, on
purpose: no one-shot example in variable tracking and common words (short contexts cannot afford
it); keys and word values are drawn from the offline corpus (``words.py``); essays start at a
random offset per sample; the generation lengths are shorter (CPU) but cover each answer.

Every draw comes from ``random.Random(f"{seed}/{task}/{context}/{sample}")``: a sample is the same
whatever else the grid holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from h2okv.errors import H2OError
from h2okv.eval.longctx.prompt import Frame, LongPrompt
from h2okv.eval.longctx.words import coded_words, distinct, english_words, random_value, variable_names

DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER's 40 needle depths
ANSWER_TOKENS = {"numbers": 12, "words": 16, "uuids": 36}  # generation length per expected value


def sample_rng(seed: int, task: str, context: int, sample: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{context}/{sample}")


def insert_at_depths(hay: list[int], breaks: list[int], segments: list[list[int]], depths: list[float]):
    """``hay`` with each segment inserted at the break nearest its depth (segments in depth order);
    ``(ids, spans)`` with the segments' ``[start, stop)`` in the result."""
    ids, spans, last = [], [], 0
    for segment, depth in sorted(zip(segments, depths, strict=True), key=lambda pair: pair[1]):
        cut = max(last, min(breaks, key=lambda b: abs(b - depth * len(hay))))
        ids += hay[last:cut]
        spans.append((len(ids), len(ids) + len(segment)))
        ids += segment
        last = cut
    return ids + hay[last:], spans


def largest_fitting(low: int, high: int, length_of, budget: int) -> int:
    """The largest ``n`` in [low, high] with ``length_of(n) <= budget`` (``length_of`` increasing)."""
    if length_of(low) > budget:
        raise H2OError(f"a context of {budget} body tokens is too short for this task")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length_of(mid) <= budget else (low, mid - 1)
    return low


def padded(frame: Frame, body: list[int], length: int) -> list[int]:
    """``body`` with line breaks after it up to ``length`` tokens (list tasks' last few tokens)."""
    newline = frame.encode("\n")
    return body + (newline * length)[: length - len(body)]


def haystack_stretch(rng, hay, length: int):
    offset = rng.randint(0, min(hay.slack(length), 20000)) if hay.slack(length) else 0
    return hay.take(length, offset)


def join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


@dataclass(frozen=True)
class Niah:
    """Needle(s) in a haystack: "One of the special magic numbers for KEY is: VALUE." Multi-key:
    distractor keys; multi-value: several values of the queried key; multi-query: several keys asked."""

    haystack: str = "essay"  # "essay": the run's --haystack; "filler": always the repeated sentences
    key: str = "words"
    value: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1
    metric: str = "string_match_all"

    def build(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int) -> LongPrompt:
        rng = sample_rng(seed, name, context, sample)
        keys = distinct(lambda: random_value(self.key, rng), max(self.keys, self.queries))
        values = [distinct(lambda: random_value(self.value, rng), self.values) for _ in keys]
        needles = [f" One of the special magic {self.value} for {k} is: {v}. " for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(len(keys)), self.queries)
        query, answers = join_query([keys[i] for i in asked]), [v for i in asked for v in values[i]]
        single = len(answers) == 1
        noun, be = (self.value[:-1], "is") if single else (self.value, "are")
        instruction = frame.encode(f"{'A' if single else 'Some'} special magic {noun} {be} hidden within the following "
                                   f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n")
        question = frame.encode(f"\nWhat {'is the' if single else 'are all the'} special magic {noun} for {query} "
                                "mentioned in the provided text?")
        prefix = frame.encode(f" The special magic {noun} for {query} mentioned in the provided text {be}")
        segments = [frame.encode(n) for n in needles]
        hay_len = frame.body_length(context, instruction, question, prefix) - sum(map(len, segments))
        hay, breaks = haystack_stretch(rng, haystacks(self.haystack), hay_len)
        body, spans = insert_at_depths(hay, breaks, segments, sorted(rng.sample(DEPTHS, len(segments))))
        ids, q = frame.assemble(instruction, body, question, prefix)
        shift = q - len(body)
        return LongPrompt(name, context, sample, ids, q, answers, self.metric, ANSWER_TOKENS[self.value] * len(answers),
                          [(a + shift, b + shift) for a, b in spans])


@dataclass(frozen=True)
class VariableTracking:
    """Chains "VAR B = VAR A" hidden in the filler: which variables hold the first one's value?"""

    chains: int = 1
    hops: int = 4
    metric: str = "string_match_all"
    max_new_tokens: int = 30

    def build(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int) -> LongPrompt:
        rng = sample_rng(seed, name, context, sample)
        names = variable_names(rng, self.chains * (self.hops + 1))
        chains = [names[i : i + self.hops + 1] for i in range(0, len(names), self.hops + 1)]
        value = str(rng.randint(10000, 99999))
        statements = []
        for chain in chains:
            first = value if chain is chains[0] else str(rng.randint(10000, 99999))
            statements += [f"\nVAR {chain[0]} = {first}\n"] + [f"\nVAR {b} = VAR {a}\n" for a, b in zip(chain, chain[1:])]
        instruction = frame.encode("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
        question = frame.encode(f"\nQuestion: Find all variables that are assigned the value {value} in the text above.")
        prefix = frame.encode(f" Answer: According to the chain(s) of variable assignment in the text above, "
                              f"{self.hops + 1} variables are assigned the value {value}, they are:")
        segments = [frame.encode(s) for s in statements]
        hay_len = frame.body_length(context, instruction, question, prefix) - sum(map(len, segments))
        hay, breaks = haystack_stretch(rng, haystacks("filler"), hay_len)
        # each chain keeps its order: its statements go to increasing depths
        depths = sorted(rng.random() for _ in segments)
        body, spans = insert_at_depths(hay, breaks, segments, depths)
        ids, q = frame.assemble(instruction, body, question, prefix)
        shift = q - len(body)
        return LongPrompt(name, context, sample, ids, q, list(chains[0]), self.metric, self.max_new_tokens,
                          [(a + shift, b + shift) for a, b in spans])


@dataclass(frozen=True)
class CommonWords:
    """A numbered list where 10 words repeat more often than the rest: name the 10 most common.
    Repeats as RULER's: 6 and 1 below 4k tokens, 30 and 3 from 4k on."""

    common: int = 10
    metric: str = "string_match_all"
    max_new_tokens: int = 120

    def build(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int) -> LongPrompt:
        rng = sample_rng(seed, name, context, sample)
        often, rarely = (6, 1) if context < 4096 else (30, 3)
        pool = rng.sample(english_words(), len(english_words()))
        instruction = frame.encode("Below is a numbered list of words. In these words, some appear more often than "
                                   "others. Memorize the ones that appear most often.\n")
        question = frame.encode(f"\nQuestion: What are the {self.common} most common words in the above list?")
        prefix = frame.encode(f" Answer: The top {self.common} words that appear most often in the list are:")
        budget = frame.body_length(context, instruction, question, prefix)
        word_ids = {w: frame.encode(" " + w) for w in pool}
        number_ids: dict[int, list[int]] = {}

        def numbered(i):
            if i not in number_ids:
                number_ids[i] = frame.encode(f" {i}.")
            return number_ids[i]

        def words(n_rare):
            return pool[: self.common] * often + pool[self.common : self.common + n_rare] * rarely

        def length(n_rare):
            listed = words(n_rare)
            return sum(len(numbered(i + 1)) + len(word_ids[w]) for i, w in enumerate(listed))

        n_rare = largest_fitting(0, len(pool) - self.common, length, budget)
        listed = words(n_rare)
        rng.shuffle(listed)
        body = [t for i, w in enumerate(listed) for t in numbered(i + 1) + word_ids[w]]
        ids, q = frame.assemble(instruction, padded(frame, body, budget), question, prefix)
        return LongPrompt(name, context, sample, ids, q, pool[: self.common], self.metric, self.max_new_tokens)


def zeta(alpha: float, terms: int = 100_000) -> float:
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


@dataclass(frozen=True)
class FrequentWords:
    """Coded words with Zipf(alpha) counts; the most frequent is replaced by dots (noise): name
    the next three."""

    alpha: float = 2.0
    metric: str = "string_match_all"
    max_new_tokens: int = 50

    def build(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int) -> LongPrompt:
        rng = sample_rng(seed, name, context, sample)
        vocab = ["...."] + coded_words(rng, max(context // 50, 8) - 1)
        instruction = frame.encode("Read the following coded text and track the frequency of each coded word. "
                                   "Find the three most frequently appeared coded words.")
        question = frame.encode("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                                "What are the three most frequently appeared words in the above coded text?")
        prefix = frame.encode(" Answer: According to the coded text above, the three most frequently appeared words are:")
        budget = frame.body_length(context, instruction, question, prefix)
        word_ids = [frame.encode(" " + w) for w in vocab]
        norm = zeta(self.alpha)

        def counts(total):
            return [int(total * k**-self.alpha / norm) for k in range(1, len(vocab) + 1)]

        def length(total):
            return sum(c * len(ids) for c, ids in zip(counts(total), word_ids))

        total = largest_fitting(1, 4 * budget, length, budget)
        listed = [i for i, c in enumerate(counts(total)) for _ in range(c)]
        rng.shuffle(listed)
        body = [t for i in listed for t in word_ids[i]]
        ids, q = frame.assemble(instruction, padded(frame, body, budget), question, prefix)
        return LongPrompt(name, context, sample, ids, q, vocab[1:4], self.metric, self.max_new_tokens)


TASKS = {
    "niah_single_1": Niah(haystack="filler"),
    "niah_single_2": Niah(),
    "niah_single_3": Niah(value="uuids"),
    "niah_single_word": Niah(value="words"),
    "niah_multikey_1": Niah(keys=4),
    "niah_multivalue": Niah(values=4),
    "niah_multiquery": Niah(keys=4, queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}


def parse_tasks(text: str) -> list[str]:
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in TASKS]
    if not names or unknown:
        named = ", ".join(unknown) if unknown else repr(text)
        raise H2OError(f"--tasks: unknown task(s) {named}; known: {', '.join(TASKS)}")
    return names


def build_prompts(frame: Frame, haystacks, task: str, context: int, samples: int, seed: int = 0) -> list[LongPrompt]:
    prompts = [TASKS[task].build(task, frame, haystacks, context, s, seed) for s in range(samples)]
    for p in prompts:
        if len(p.ids) != context:  # an internal error, never bad input: sizes are computed, not searched
            raise AssertionError(f"{task}: a prompt of {len(p.ids)} tokens, {context} wanted")
    return prompts
