"""What ``h2okv demo`` runs, as library functions: the retrieval cases, the caches it compares, and a
long generation whose KV bytes are recorded as it goes.

Part one asks for a passkey hidden in a long prompt. The prompt is ``eval retrieval``'s (same
instruction, needle, filler and question, a plain prompt without a chat template), the setting in
which the ``bounded`` recipe found 17 of 20 passkeys at 20% (full 18). A sliding window of the same
size (``local``) keeps only the prompt's last fifth, so a passkey placed earlier cannot survive in
it: the same memory, spent without looking at what matters, loses the answer.

Part two generates a long text with the ``generation`` recipe at a fixed slot budget: its KV bytes
stop growing once the budget is full, while a full cache's grow with every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.eval.haystack import Haystack
from h2okv.eval.retrieval import build_prompt, is_correct

# (prompt tokens, needle depth, passkey). Chosen on the default model: full, the bounded recipe at
# 20% and local at 20% answered as expected on every one of 18 prompts tried (768 and 1024 tokens,
# depths 0.2/0.5/0.8, three passkeys each); two depths show it is not one lucky position. Both
# passkeys lie well before the last 20% of the prompt, which is all that local keeps.
PASSKEY_CASES = ((1024, 0.25, "62465"), (1024, 0.6, "25164"))

# the caches part one compares, all but full at the same 20% of the prompt
RETRIEVAL_BUDGET = 0.2
RETRIEVAL_CONFIGS = (
    ("full", {"policy": "full"}),
    ("recipe bounded", {"recipe": "bounded", "budget": RETRIEVAL_BUDGET}),
    ("local", {"policy": "local", "budget": RETRIEVAL_BUDGET}),
)

# part two: a short request that makes an instruction-tuned model write at length
STORY_REQUEST = "Write a long story about a lighthouse keeper who finds a message in a bottle."
GENERATION_SLOTS = 128  # per layer and KV head: the whole budget, whatever the output's length
GENERATION_CONFIG = {"recipe": "generation", "budget": GENERATION_SLOTS}
# greedy decoding of a 135M model loops within a few hundred tokens; a mild penalty keeps the text
# readable (1.3 turned the recipe's tail into symbols, 1.15 stayed a story)
REPETITION_PENALTY = 1.15


@dataclass(frozen=True)
class RetrievalCase:
    title: str
    ids: list[int]
    passkey: str
    depth: float
    needle: tuple[int, int]  # [start, stop) token positions of the needle in ``ids``

    def is_right(self, answer: str) -> bool:
        return is_correct(answer, self.passkey)


def passkey_case(tokenizer, tokens: int, depth: float, passkey: str, haystack: Haystack | None = None) -> RetrievalCase:
    """A prompt of exactly ``tokens`` tokens of ``tokenizer`` with ``passkey`` at ``depth`` of the
    filler (0: right after the instruction, 1: right before the question)."""
    prompt = build_prompt(tokenizer, haystack or Haystack(tokenizer, "filler"), tokens, depth, passkey)
    title = f"passkey {passkey} at {depth:.0%} of a {tokens}-token prompt"
    return RetrievalCase(title, prompt.ids, passkey, depth, prompt.needle)


def retrieval_cases(tokenizer, cases=None) -> list[RetrievalCase]:
    """The demo's cases (default ``PASSKEY_CASES``), built with this model's tokenizer: lengths are
    in its tokens."""
    haystack = Haystack(tokenizer, "filler")
    return [passkey_case(tokenizer, tokens, depth, key, haystack) for tokens, depth, key in cases or PASSKEY_CASES]


@dataclass(frozen=True)
class Answer:
    config: str
    text: str
    right: bool
    kv_bytes: int
    summary: str  # H2OCache.summary(): what the cache expanded to and what it kept


def answer(model, tokenizer, case: RetrievalCase, config: str, cache_keywords: dict, max_new_tokens: int = 8) -> Answer:
    """Greedy answer to ``case`` with a fresh ``H2OCache(model, **cache_keywords)``."""
    import torch

    from h2okv.core.cache import H2OCache
    from h2okv.core.compat import cache_arg

    cache = H2OCache(model, **cache_keywords)
    ids = torch.tensor([case.ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return Answer(config, text, case.is_right(text), cache.stats()["kv_bytes"], cache.summary())


class KVLine:
    """A ``LogitsProcessor`` that records ``(tokens seen, KV bytes held, KV bytes a full cache would
    hold)`` every ``every`` tokens. The full line is the cache's own ``full_kv_bytes``: every position
    seen, for every layer and KV head, in the same dtype, which is exactly what an
    ``H2OCache(policy="full")`` holds after the same tokens, without generating them twice."""

    def __init__(self, cache, every: int, on_point=None):
        self.cache, self.every, self.points, self.on_point = cache, every, [], on_point

    def record(self) -> None:
        seen = self.cache.get_seq_length()
        if self.points and self.points[-1][0] == seen:
            return
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        self.points.append((seen, sum(layer.kv_bytes() for layer in layers),
                            sum(layer.full_kv_bytes() for layer in layers)))
        if self.on_point is not None:  # the demo prints the line as it grows
            self.on_point(*self.points[-1])

    def __call__(self, input_ids, scores):
        if not self.points or self.cache.get_seq_length() % self.every == 0:
            self.record()
        return scores


@dataclass(frozen=True)
class LongGeneration:
    text: str
    prompt_tokens: int
    points: list[tuple[int, int, int]]  # KVLine's (tokens seen, kv bytes, full kv bytes)
    summary: str


def prompt_ids(tokenizer, request: str) -> list[int]:
    """``request`` in the chat template when the tokenizer has one (an instruction-tuned model
    writes at length when asked as a user), else plain."""
    if getattr(tokenizer, "chat_template", None):
        from h2okv.generation import chat_prompt_ids

        return chat_prompt_ids(tokenizer, request)
    return tokenizer(request, add_special_tokens=False)["input_ids"]


def long_generation(model, tokenizer, new_tokens: int, every: int = 25, request: str = STORY_REQUEST,
                    cache_keywords: dict = GENERATION_CONFIG, on_point=None) -> LongGeneration:
    """Exactly ``new_tokens`` greedy tokens (repetition-penalised) under ``cache_keywords``, with the
    KV bytes every ``every`` tokens (each also handed to ``on_point(seen, kv, full)``)."""
    import torch
    from transformers import LogitsProcessorList

    from h2okv.core.cache import H2OCache
    from h2okv.core.compat import cache_arg

    cache = H2OCache(model, **cache_keywords)
    line = KVLine(cache, every, on_point)
    ids = torch.tensor([prompt_ids(tokenizer, request)], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             repetition_penalty=REPETITION_PENALTY, pad_token_id=tokenizer.pad_token_id,
                             logits_processor=LogitsProcessorList([line]))
    line.record()  # the last token's K/V are written after the last logits call
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return LongGeneration(text, ids.shape[1], line.points, cache.summary())
