"""Generation with an eviction policy: the cache for a run, tokenising, padding a batch, running
``model.generate`` with an ``H2OCache``, reporting."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from transformers import DynamicCache, LogitsProcessorList, TextStreamer

from h2okv.core.budget import DEFAULT_RECENT_SHARE, fraction_keywords, slots_keywords
from h2okv.core.cache import DEFAULT_CHUNK, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import read_context, read_ids
from h2okv.errors import H2OError
from h2okv.settings import CacheSettings
from h2okv.window import check_fits, context_window


@dataclass
class Generation:
    text: str
    new_tokens: int
    stats: dict
    token_ids: list[int]


def budget_kwargs(heavy=None, recent=None, heavy_ratio=None, recent_ratio=None) -> dict:
    """Only the budget arguments the user actually gave (so ``H2OCache`` can validate the mix)."""
    given = {"heavy": heavy, "recent": recent, "heavy_ratio": heavy_ratio, "recent_ratio": recent_ratio}
    return {k: v for k, v in given.items() if v is not None}


def new_cache(model, policy: str | None, fraction: float | None = None, chunk_size: int = DEFAULT_CHUNK,
              seed: int = 0, recent_share: float = DEFAULT_RECENT_SHARE, prefill: str = "chunked",
              slots: int | None = None, budget_floor: int = 0, **options):
    """The cache for one evaluation run: an ``H2OCache`` under ``policy`` keeping ``fraction`` of
    each prompt (``fraction_keywords``, ``recent_share`` of it recent) or, given ``slots``, that many
    tokens per layer and KV head (``slots_keywords``, ``recent_share`` of them recent) - both ignored
    for a policy that keeps everything - with the ``prefill`` mode (``H2OCache``), or, for
    ``policy=None``, the plain ``DynamicCache`` transformers runs by default (the benchmarks'
    baseline). An evaluation measures the fraction it names, so there is no budget floor unless
    ``budget_floor`` says so. ``options`` are further ``H2OCache`` keywords, passed through unread
    (evaluations' ``--cache-option``, a recipe's settings); an unknown one is a one-line error."""
    if policy is None:
        return DynamicCache(config=model.config)
    budget = fraction_keywords(policy, fraction, recent_share) if slots is None else slots_keywords(policy, slots, recent_share)
    if clash := sorted(set(options) & {"policy", "chunk_size", "seed", "recipe", "budget", *budget}):
        raise H2OError(f"cache option(s) {', '.join(clash)} are set by the evaluation itself")
    # an unknown option is CacheSettings' one-line error ("unknown cache setting(s): ...")
    return H2OCache(model, policy=policy, chunk_size=chunk_size, seed=seed, prefill=prefill,
                    budget_floor=budget_floor, **budget, **options)


def read_ahead(model, tokenizer, cache, ids: torch.Tensor, end: int | None = None, chat_head: int = 0) -> None:
    """Before ``generate``: read ``ids[:, :end]`` into ``cache``, which evicts to its budget before
    the rest exists (a question-agnostic context: never held for the question, ``core/held.py``);
    ``generate`` then reads only what is left.

    A policy ranked by reconstruction (``kvzip``) always reads ahead, all but the prompt's last
    token when ``end`` is None, and is ranked by ``reconstruct`` (which repeats the context from
    ``chat_head`` on: the chat template's own head is not text to reproduce). Call it under
    ``torch.inference_mode``."""
    if end is None and not cache.policy.ranks_by_reconstruction:
        return
    context = ids[:, : ids.shape[1] - 1 if end is None else end].to(model.device)
    if end is not None:  # a question-agnostic context: ranked by its own end, as the user asked
        read_context(model, tokenizer, cache, context, start=chat_head, hold=False)
    else:  # the prompt with its question: its end is the question, nothing to warn of
        read_ids(model, tokenizer, cache, context, start=chat_head)


def read_in_pieces(model, cache, ids: torch.Tensor, window: int) -> None:
    """Rolling positions take forward calls of at most ``window`` tokens, the kept ones included
    (``core/positions.py``): all of a longer prompt but its last piece is read ahead in pieces
    (``generate`` then reads the rest). The budget is fixed by the whole prompt first, so that a
    fraction is of the prompt, not of its first piece."""
    if ids.shape[1] <= window:
        return
    cache.row_budgets.for_call(torch.ones_like(ids, dtype=torch.bool), "cpu")
    budget = cache.row_budgets.max_budget
    piece = window - int(budget) if budget < window else window  # else the positions say what does not fit
    with torch.inference_mode():
        for start in range(0, (ids.shape[1] - 1) // piece * piece, piece):
            model(input_ids=ids[:, start:start + piece], **cache_arg(cache), use_cache=True, logits_to_keep=1)


def pad_rows(rows: list[list[int]], pad_id: int, device="cpu", side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for token lists padded to one length on ``side``: "left"
    for prompts (generation continues at the right edge), "right" for continuations read after a
    cache, which moves each row's real tokens first."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """``prompt`` as the user's message in the tokenizer's chat template, then the assistant's turn
    (how an instruction-tuned model expects a request); a one-line error when there is no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise H2OError("--chat needs a tokenizer with a chat template; this model's tokenizer has none")
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_dict=True)
    return list(enc["input_ids"])


def encode_prompt(tokenizer, prompt: str, chat: bool = False, device="cpu") -> dict:
    if chat:
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


class KVWatch:
    """A ``LogitsProcessor`` that records ``(tokens seen, KV bytes)`` every ``every`` tokens: the
    memory of a long generation, step by step, without a second pass. ``on_record(seen, bytes,
    tokens and seconds since the first record)`` is told each one as it happens (a long run shows
    it live)."""

    def __init__(self, cache: H2OCache, every: int, on_record=None):
        self.cache, self.every, self.history, self.on_record = cache, every, [], on_record
        self.began = None

    def __call__(self, input_ids, scores):
        seen = self.cache.get_seq_length()
        if seen % self.every == 0 or not self.history:
            self.history.append((seen, sum(layer.kv_bytes() for layer in self.cache.layers)))
            now = time.perf_counter()
            self.began = now if self.began is None else self.began
            if self.on_record is not None:
                self.on_record(*self.history[-1], seen - self.history[0][0], now - self.began)
        return scores


@dataclass(frozen=True)
class GenerationOptions:
    """How ``generate`` decodes: greedy unless ``temperature`` > 0 (then sampled with ``top_p``,
    seeded by ``seed``); ``ignore_eos`` generates exactly ``max_new_tokens``."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


GENERATION_FIELDS = frozenset(f.name for f in fields(GenerationOptions))


def generate(model, tokenizer, prompt: str, settings: CacheSettings | str | None = None,
             options: GenerationOptions | None = None, *, chat: bool = False, stream: bool = False,
             kv_every: int | None = None, on_kv=None, compile: str | None = None, **keywords) -> Generation:
    """``prompt`` (wrapped in the chat template with ``chat``) continued under the cache
    ``settings`` (a ``CacheSettings``, or a policy name), decoded as ``options`` say.
    ``keywords`` are either ``GenerationOptions`` fields (``max_new_tokens=``, ``temperature=``...)
    or ``H2OCache``'s (``recipe=``, ``budget=``...), each given beside a value of its kind only
    when that value is not. ``positions="rolling"`` goes on past the context window.
    ``kv_every``: ``stats["kv_history"]`` gets ``(tokens seen, KV bytes)`` every that many tokens,
    each also handed to ``on_kv(seen, bytes, tokens since the first, seconds)`` as it happens
    (``KVWatch``). A policy ranked by reconstruction (``kvzip``, the ``prompt`` and ``document``
    recipes) is ranked inside ``model.generate``, the whole prompt before the first decode step,
    as any drop-in use is (``core/autorank.py``).
    ``compile``: a ``torch.compile`` backend ("inductor", or "inductor:MODE") for the decode steps at the budget
    (``H2OCache(compileable=True)``); steps while rows fill up may run eagerly."""
    decoding = {name: keywords.pop(name) for name in list(keywords) if name in GENERATION_FIELDS}
    if options is None:
        options = GenerationOptions(**decoding)
    elif decoding:
        raise H2OError(f"give generate GenerationOptions or decoding keywords, not both (also given: "
                       f"{', '.join(sorted(decoding))})")
    if isinstance(settings, CacheSettings):
        if keywords:
            raise H2OError(f"give generate a CacheSettings or cache keywords, not both (also given: "
                           f"{', '.join(sorted(keywords))})")
    else:
        settings = CacheSettings.build(settings, **keywords)
    if compile is not None:
        settings = settings.replace(compileable=True)
    cache = H2OCache(model, settings, tokenizer=tokenizer)
    inputs = encode_prompt(tokenizer, prompt, chat=chat, device=model.device)
    if cache.rolling is None:  # before any forward pass: past the window true positions write garbage
        check_fits(inputs["input_ids"].shape[1], options.max_new_tokens, context_window(model.config))
    else:
        read_in_pieces(model, cache, inputs["input_ids"], cache.rolling.window)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    watch = KVWatch(cache, kv_every, on_kv) if kv_every else None
    sampling = {"do_sample": False}
    if options.temperature > 0:
        sampling = {"do_sample": True, "temperature": options.temperature, "top_p": options.top_p, "top_k": 0}
        torch.manual_seed(options.seed)  # the same on every --tp rank: all ranks draw the same tokens
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            **cache_arg(cache),
            max_new_tokens=options.max_new_tokens,
            repetition_penalty=options.repetition_penalty,
            min_new_tokens=options.max_new_tokens if options.ignore_eos else None,
            **sampling,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([watch] if watch else []),
            **compile_options(compile),
        )
    new = out[0, inputs["input_ids"].shape[1] :]
    stats = cache.stats()
    if watch is not None:
        stats["kv_history"] = watch.history + [(stats["tokens_seen"], stats["kv_bytes"])]
    return Generation(tokenizer.decode(new, skip_special_tokens=True), int(new.numel()), stats, new.tolist())


def compile_options(backend: str | None) -> dict:
    """``model.generate``'s keywords that compile its decode steps with ``backend`` (none: eager).
    Not fullgraph: steps while rows fill up to their budget break the graph and run eagerly; at
    the budget every step is one graph (tests/core/test_compile.py)."""
    if backend is None:
        return {}
    from transformers import CompileConfig

    name, mode = backend, None
    if isinstance(backend, str):  # "inductor:reduce-overhead": CUDA graphs on a GPU
        name, _, mode = backend.partition(":")
    config = CompileConfig(fullgraph=False, dynamic=False, backend=name, mode=mode or None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return {"compile_config": config}


def summary_line(stats: dict) -> str:
    mib = 1024 * 1024
    slots = max(stats["slots"]) if stats["slots"] else 0
    ratio = stats["kv_bytes"] / stats["full_kv_bytes"] if stats["full_kv_bytes"] else 0.0
    line = (
        f"[{stats.get('policy_spec', stats['policy'])}{', recipe ' + stats['recipe'] if stats.get('recipe') else ''}] tokens seen {stats['tokens_seen']}, slots kept {slots} per layer/head, "
        f"KV {stats['kv_bytes'] / mib:.2f} MiB vs full-cache {stats['full_kv_bytes'] / mib:.2f} MiB ({ratio:.1%})"
    )
    if stats.get("kv_bits") is not None and stats.get("full_kv_bytes_16bit") not in (None, stats["full_kv_bytes"]):
        line += f"; {stats['kv_coding']}: {stats['kv_share_16bit']:.1%} of a 16-bit full cache"
    ranks = stats.get("per_rank") or []
    if len(ranks) > 1:  # tensor parallel (h2okv.parallel.stats.gather_stats): the totals above are summed
        each = ", ".join(f"{r['kv_bytes'] / mib:.2f}" for r in ranks)
        line += f"; {len(ranks)} tensor-parallel ranks hold {each} MiB each"
    return line
