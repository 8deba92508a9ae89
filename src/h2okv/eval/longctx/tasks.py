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

Several questions over one context (``build_question_sets``, ``--questions-per-context N``): the
needle families plant the items of N questions (each question's own keys, plus the family's
distractors) and variable tracking N chains of distinct values; each question is then a prompt of
its own with the one shared context. Their question parts are padded in front with line breaks to
one length, so every prompt is still exactly ``context`` tokens. With N = 1 the draws and texts are
those of ``build_prompts``. The word-count families ask one question of the whole list: no N form.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.errors import H2OError
from h2okv.eval.longctx.parts import (  # noqa: F401 - re-exported: tests and qa.py's callers import them here
    ANSWER_TOKENS,
    DEPTHS,
    Asked,
    ManyQuestions,
    even_questions,
    hay_length,
    haystack_stretch,
    insert_at_depths,
    join_query,
    largest_fitting,
    needle_depths,
    over_one_context,
    padded,
    sample_rng,
)
from h2okv.eval.longctx.prompt import Frame, LongPrompt
from h2okv.eval.longctx.qa import QA_TASKS
from h2okv.eval.longctx.words import coded_words, distinct, english_words, random_value, variable_names


@dataclass(frozen=True)
class Niah(ManyQuestions):
    """Needle(s) in a haystack: "One of the special magic numbers for KEY is: VALUE." Multi-key:
    distractor keys; multi-value: several values of the queried key; multi-query: several keys asked."""

    haystack: str = "essay"  # "essay": the run's --haystack; "filler": always the repeated sentences
    key: str = "words"
    value: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1
    metric: str = "string_match_all"

    def build_many(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int,
                   questions: int) -> list[LongPrompt]:
        rng = sample_rng(seed, name, context, sample)
        # each question's own keys, then the family's distractors (keys no question asks)
        count = questions * self.queries + max(self.keys - self.queries, 0)
        keys = distinct(lambda: random_value(self.key, rng), count)
        values = [distinct(lambda: random_value(self.value, rng), self.values) for _ in keys]
        needles = [f" One of the special magic {self.value} for {k} is: {v}. " for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        order = rng.sample(range(len(keys)), questions * self.queries)
        groups = [order[i : i + self.queries] for i in range(0, len(order), self.queries)]
        asked = even_questions(frame, [self.ask(frame, [keys[i] for i in g], [v for i in g for v in values[i]])
                                       for g in groups])
        instruction = self.instruction(frame, single=questions == 1 and len(asked[0].references) == 1)
        segments = [frame.encode(n) for n in needles]
        hay, breaks = haystack_stretch(rng, haystacks(self.haystack), hay_length(frame, context, instruction, asked[0], segments))
        body, spans = insert_at_depths(hay, breaks, segments, needle_depths(rng, len(segments)))
        return over_one_context(name, frame, context, sample, self.metric, instruction, body, spans, asked)

    def instruction(self, frame: Frame, single: bool) -> list[int]:
        noun, be = (self.value[:-1], "is") if single else (self.value, "are")
        return frame.encode(f"{'A' if single else 'Some'} special magic {noun} {be} hidden within the following "
                            f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n")

    def ask(self, frame: Frame, keys: list[str], answers: list[str]) -> Asked:
        query, single = join_query(keys), len(answers) == 1
        noun, be = (self.value[:-1], "is") if single else (self.value, "are")
        question = frame.encode(f"\nWhat {'is the' if single else 'are all the'} special magic {noun} for {query} "
                                "mentioned in the provided text?")
        prefix = frame.encode(f" The special magic {noun} for {query} mentioned in the provided text {be}")
        return Asked(question, prefix, answers, ANSWER_TOKENS[self.value] * len(answers))


@dataclass(frozen=True)
class VariableTracking(ManyQuestions):
    """Chains "VAR B = VAR A" hidden in the filler: which variables hold the first one's value?"""

    chains: int = 1
    hops: int = 4
    metric: str = "string_match_all"
    max_new_tokens: int = 30

    def build_many(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int,
                   questions: int) -> list[LongPrompt]:
        """One chain per question (values distinct), then the family's other chains."""
        rng = sample_rng(seed, name, context, sample)
        names = variable_names(rng, (self.chains + questions - 1) * (self.hops + 1))
        chains = [names[i : i + self.hops + 1] for i in range(0, len(names), self.hops + 1)]
        values = distinct(lambda: str(rng.randint(10000, 99999)), questions)
        values += [str(rng.randint(10000, 99999)) for _ in chains[questions:]]
        per_chain = [[f"\nVAR {chain[0]} = {value}\n"] + [f"\nVAR {b} = VAR {a}\n" for a, b in zip(chain, chain[1:])]
                     for chain, value in zip(chains, values, strict=True)]
        # the chains interleaved, each in its own order: every chain spans the whole text
        statements = [s for step in zip(*per_chain) for s in step]
        instruction = frame.encode("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
        asked = even_questions(frame, [self.ask(frame, value, chain) for value, chain in zip(values, chains[:questions])])
        segments = [frame.encode(s) for s in statements]
        hay, breaks = haystack_stretch(rng, haystacks("filler"), hay_length(frame, context, instruction, asked[0], segments))
        # statements in order go to increasing depths
        body, spans = insert_at_depths(hay, breaks, segments, sorted(rng.random() for _ in segments))
        return over_one_context(name, frame, context, sample, self.metric, instruction, body, spans, asked)

    def ask(self, frame: Frame, value: str, chain: list[str]) -> Asked:
        question = frame.encode(f"\nQuestion: Find all variables that are assigned the value {value} in the text above.")
        prefix = frame.encode(f" Answer: According to the chain(s) of variable assignment in the text above, "
                              f"{self.hops + 1} variables are assigned the value {value}, they are:")
        return Asked(question, prefix, list(chain), self.max_new_tokens)


@dataclass(frozen=True)
class CommonWords:
    """A numbered list where 10 words repeat more often than the rest: name the 10 most common.
    Repeats as RULER's: 6 and 1 below 4k tokens, 30 and 3 from 4k on."""

    common: int = 10
    metric: str = "string_match_all"
    max_new_tokens: int = 120
    many_questions = False  # one question of the whole list

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
    many_questions = False  # one question of the whole text

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
    **QA_TASKS,  # real questions over real text (qa.py): SQuAD, DROP, CoQA, planted facts
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
    check_lengths(prompts, context)
    return prompts


def build_question_sets(frame: Frame, haystacks, task: str, context: int, samples: int, seed: int = 0,
                        questions: int = 1) -> list[list[LongPrompt]]:
    """Per sample, ``questions`` prompts over one shared context (``ids[:question]`` equal)."""
    check_questions([task], questions)
    family = TASKS[task]
    sets = [family.build_many(task, frame, haystacks, context, s, seed, questions) if questions > 1
            else [family.build(task, frame, haystacks, context, s, seed)] for s in range(samples)]
    check_lengths([p for prompts in sets for p in prompts], context)
    return sets


def check_lengths(prompts: list[LongPrompt], context: int) -> None:
    for p in prompts:
        if len(p.ids) != context:  # an internal error, never bad input: sizes are computed, not searched
            raise AssertionError(f"{p.task}: a prompt of {len(p.ids)} tokens, {context} wanted")


def check_questions(tasks: list[str], questions: int) -> None:
    """A one-line error for N < 1, or N > 1 with a task that asks one question of its whole text."""
    if questions < 1:
        raise H2OError(f"--questions-per-context must be >= 1, got {questions}")
    single = [t for t in tasks if not TASKS[t].many_questions]
    if questions > 1 and single:
        many = ", ".join(t for t in TASKS if TASKS[t].many_questions)
        raise H2OError(f"--questions-per-context {questions}: {', '.join(single)} ask(s) one question of the whole "
                       f"text; several questions per context work for {many}")
