"""KVzip's reconstruction pass (policy ``kvzip``): rank a prompt by how the model repeats it.

The public pass is ``h2okv.reconstruct`` and ``h2okv.read_context`` (defined here); the probe
attention at the end of this module is what each layer runs during that pass (``SlotLayer``).

KVzip (Kim et al. 2025) asks which cached tokens the model needs to reproduce its context, with
no question in sight: the same ranking then serves any question asked later (a cached document
many questions reuse). Usage::

    cache = H2OCache(model, recipe="document", budget=0.2)   # kvzip, read whole, cache-wide split
    read_context(model, tokenizer, cache, context)           # read, probe, rank, evict to the budget
    model.generate(input_ids=torch.cat([context, question], 1), cache=cache, ...)

(``read_context`` is ``model(input_ids=context, cache=cache)`` then ``reconstruct``.)

(``cache=`` is transformers >= 5.24's name; older releases call it ``past_key_values=``.)

The probe is "repeat the previous context exactly", the chat template's end of the user turn
(so the model answers as the assistant) and the context again, in chunks of ``chunk_size`` tokens
(a later chunk's instruction quotes the last tokens before it, so the model knows where to go on).
``start`` leaves the prompt's first tokens (a chat template's system turn) out of the repeated
text; they are still ranked. Cost: one more prefill of the context, through the whole model.

**The probe call inside a layer** (``probe_attention``): attention of tokens that are read on top
of the cache and never kept, and the score each cached slot earns. A probe call attends exactly as
a prefill call would (every live slot, plus the probe's own tokens up to each query), so the
model's hidden states through the probe are those of a full cache reading the same text. Nothing
is written: the probe's keys and values live only for the call. Each live slot's score is the
largest probability any probe query of its KV head's query group gives it (KVzip's max over the
group and the queries). The queries run in blocks, so a probability block is
``[block x (capacity + probe)]``, and a block holds at most ``PROBE_BLOCK_BYTES`` of float32
logits (``CPU_PROBE_BLOCK_BYTES`` on a CPU, where a block that stays in cache is faster): with
the chunk size alone (512 queries) the block grows with the prompt, and on a 16k
prompt the probe's blocks took the ``prompt`` recipe's peak to 2.9x full's (an H200, bf16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from h2okv.chat import chat_frame, encode_text
from h2okv.core.compat import cache_arg, without_grad
from h2okv.core.head_budget import allocate_layers
from h2okv.core.held import hold_rows, release, wants_hold, warn_if_ranked_by_its_end
from h2okv.documents import read_arguments
from h2okv.errors import H2OError

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
QUOTED = 8  # tokens of the previous chunk a later chunk's instruction quotes
DEFAULT_CHUNK = 2048
# the float32 logits one probe block may hold; the softmax and its 16-bit copy take as much again
# and half of it. A smaller block ranks the same: each query's row is its own softmax, and the max
# (or, for the streamed probe, the sum) is taken across blocks; only a matmul's rounding moves
PROBE_BLOCK_BYTES = 64 * 2**20
# on a CPU a block of logits that fits a core's L2 cache (4 MiB here) is read and written by the
# softmax, the max and the value product without going out to memory: a probe call at 8k (0.5B's
# shapes) took 1.25 s per layer against 2.33 s with 64 MiB blocks (medians of 3), the same bits
# (``tools/measure/probe_blocks.py``, docs/results/probe-blocks-8k.json). An accelerator wants its
# larger blocks.
CPU_PROBE_BLOCK_BYTES = 4 * 2**20


def probe_block_bytes(device: torch.device) -> int:
    """The most float32 logits one probe block holds on ``device``."""
    return min(PROBE_BLOCK_BYTES, CPU_PROBE_BLOCK_BYTES) if device.type == "cpu" else PROBE_BLOCK_BYTES


def turn_end(tokenizer) -> list[int]:
    """The ids a chat template puts after a user message up to the assistant's turn ("\\n" without
    a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_text(tokenizer, "\n")
    return encode_text(tokenizer, chat_frame(tokenizer)[1])


def probes(tokenizer, context: torch.Tensor, start: int = 0, chunk_size: int = DEFAULT_CHUNK) -> list[torch.Tensor]:
    """The probe calls ``[B, p]`` for ``context`` ``[B, n]``: instruction, turn end, a chunk of the context."""
    if chunk_size < 1:
        raise H2OError(f"chunk_size must be >= 1, got {chunk_size}")
    n = context.shape[1]
    if not 0 <= start < n:
        raise H2OError(f"start must be in [0, {n}) for a context of {n} tokens, got {start}")
    tail = torch.tensor(turn_end(tokenizer), dtype=context.dtype, device=context.device)
    calls = []
    for first in range(start, n, chunk_size):
        part = context[:, first:first + chunk_size]
        head = torch.tensor(encode_text(tokenizer, FIRST if first == start else NEXT), dtype=context.dtype,
                            device=context.device).expand(context.shape[0], -1)
        if first > start:
            head = torch.cat([head, context[:, max(start, first - QUOTED):first]], dim=1)
        calls.append(torch.cat([head, tail.expand(context.shape[0], -1), part], dim=1))
    return calls


def probe_spans(n: int, start: int = 0, chunk_size: int = DEFAULT_CHUNK) -> list[tuple[int, int, int]]:
    """``(head, first, stop)`` for each of ``probes``' calls over an ``n``-token context: the call
    repeats prompt positions ``[first, stop)``, and the prompt's first ``head`` tokens (``start``,
    a chat template's head) are not repeated. ``kvzip:local=1`` scores each call on them."""
    return [(start, first, min(first + chunk_size, n)) for first in range(start, n, chunk_size)]


class ProbePlan(NamedTuple):
    """A served prompt's probe ``calls`` (id lists) and each call's ``probe_spans`` entry."""

    calls: list[list[int]]
    spans: list[tuple[int, int, int]]


def prompt_probes(tokenizer, prompt: list[int], chunk_size: int = DEFAULT_CHUNK) -> ProbePlan:
    """The probe calls (id lists) for a ``prompt`` of which all but the last token is read and
    ranked, the last one then read on the ranked cache (as ``eval longctx`` does, so the first
    generated token already sees the ranked cache), with their spans (``kvzip:local=1`` scores
    each call on its own). A chat template's head that opens the prompt is ranked but not repeated
    (``reconstruct``'s ``start``); it is encoded once for both. Used by the server."""
    context = list(prompt[:-1])
    if not context:
        raise H2OError("a prompt ranked by reconstruction needs at least 2 tokens")
    start = chat_head_length(tokenizer, context)
    calls = [call[0].tolist() for call in probes(tokenizer, torch.tensor([context]), start, chunk_size)]
    return ProbePlan(calls, probe_spans(len(context), start, chunk_size))


def reconstruct(model, cache, context: torch.Tensor, tokenizer, start: int = 0,
                chunk_size: int = DEFAULT_CHUNK) -> None:
    """Rank the prompt ``cache`` holds (``context`` ``[B, n]``: the ids it read, one length, no
    padding) by the attention the model pays it while repeating it, then evict every layer to its
    budget. The cache's policy must rank by reconstruction (``kvzip``). A prompt past its
    ``probe_upto`` builds no probe, so ``tokenizer`` may then be None."""
    if not cache.policy.ranks_by_reconstruction:
        raise H2OError(f"reconstruct ranks a cache whose policy ranks by reconstruction (kvzip), "
                       f"not {cache.policy.spec!r}")
    context = torch.as_tensor(context)
    if context.dim() != 2 or cache.get_seq_length() != context.shape[1] or cache.rows != context.shape[0]:
        raise H2OError(f"reconstruct needs the [rows, tokens] ids the cache has read: it holds {cache.rows} rows "
                       f"of {cache.get_seq_length()} tokens, got shape {tuple(context.shape)}")
    if not all(layer.probe.awaiting for layer in cache.layers):
        raise H2OError("reconstruct needs a cache that has read the prompt in one call and not been ranked yet")
    # past kvzip's ``probe_upto`` the question's attention alone ranks: no probe to build (nor a tokenizer)
    probed = cache.policy.runs_probe(context.shape[1])
    if probed and tokenizer is None:
        raise H2OError(f"reconstruct builds the probe of this {context.shape[1]}-token prompt with the tokenizer: "
                       f"give the model's tokenizer")
    calls = probes(tokenizer, context.to(model.device), start, chunk_size) if probed else []
    rank_by_probes(model, cache, calls, probe_spans(context.shape[1], start, chunk_size))


def rank_by_probes(model, cache, calls: list[torch.Tensor], spans: list[tuple[int, int, int]] | None = None) -> None:
    """Read the probe ``calls`` (``probes``' output, already built: the server builds them where
    its tokenizer lives) on top of ``cache``, which has read its prompt whole and not been ranked,
    then evict every layer to its budget by the scores they give. ``spans``: each call's
    ``probe_spans`` entry, which ``kvzip:local=1`` scores on (the others need none)."""
    if not cache.policy.ranks_by_reconstruction:  # only such a policy has the probe's hooks
        raise H2OError(f"rank_by_probes ranks a cache whose policy ranks by reconstruction, not {cache.policy.spec!r}")
    # a prompt past the policy's ``probe_upto`` is ranked by its question's attention alone
    probed = cache.policy.runs_probe(cache.get_seq_length())
    local = probed and calls and cache.policy.local
    if local and (spans is None or len(spans) != len(calls)):
        raise H2OError(f"policy {cache.policy.spec!r} scores each probe call on the part of the prompt it "
                       f"repeats: give rank_by_probes each call's span (probe_spans), or use h2okv.reconstruct")
    for layer in cache.layers:
        layer.start_probe()
    try:
        with without_grad(cache):
            for i, ids in enumerate(calls if probed else ()):
                for layer in cache.layers:
                    layer.probe.span = spans[i] if local else None
                model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
            for layer in cache.layers:
                layer.take_probe_scores(probed)
            shares = [None] * len(cache.layers)
            if cache.head_budgets == "layers":  # KVzip's own split: the whole cache's slots by rank
                keys, candidates = zip(*(layer.ranking() for layer in cache.layers), strict=True)
                first = cache.layers[0]
                shares = allocate_layers(list(keys), list(candidates), first.ranked_heavy(), first.sinks,
                                         cache.head_floor, cache.policy.ceiling)
            for layer, share in zip(cache.layers, shares, strict=True):
                layer.rank_by_probe(share)
    finally:
        for layer in cache.layers:
            layer.probe.span = None
            layer.stop_probe()


def read_context(model, tokenizer, cache=None, context=None, start: int | None = None,
                 hold: bool | None = None) -> None:
    """Read ``context`` into ``cache`` before any question exists: ready for questions read
    afterwards (``h2okv.ask``, or ``model.generate(input_ids=context + question, cache=cache)``,
    which feeds only what is new). ``context`` is text or chat messages (through the tokenizer's
    chat template, ``h2okv.documents``) or token ids (``[rows, tokens]``, or one list).

    Any policy works. Most leave the context compressed to its budget; one that ranks by
    reconstruction (``kvzip``, the ``document`` recipe) is ranked here by ``reconstruct``, which
    needs the ``tokenizer`` (None will do otherwise, for ids). One that ranks a call by its last
    queries (``snapkv``, the ``bounded`` recipe) is **held** instead (``hold``, default: where the
    cache can, ``core/held.py``): read evicting nothing, it is ranked by the question's call, each
    of ``ask``'s copies by its own question, and brought down to the budget then; until then the
    cache holds the whole context. ``hold=False`` compresses it now, ranked by its own end;
    ``hold=True`` where the cache cannot is a one-line ``H2OError``. ``start`` leaves a chat
    template's head out of the repeated text (default: found from the tokenizer's template). The
    order ``(model, cache, context, tokenizer)`` still works, with a DeprecationWarning, for one
    release. A context this cache would rank by its own end (``kvzip`` past ``probe_upto``: the
    ``prompt`` recipe past 2,560 tokens) is read with a warning that names what to use instead."""
    tokenizer, cache, document = read_arguments(tokenizer, cache, context)
    ids = document.ids.to(model.device)
    held = wants_hold(cache, hold)
    if not held:
        warn_if_ranked_by_its_end(cache, ids.shape[1])
    read_ids(model, tokenizer, cache, ids, start, held)


def read_ids(model, tokenizer, cache, ids: torch.Tensor, start: int | None = None, held: bool = False) -> None:
    """``read_context``'s read of ``[rows, tokens]`` ids on ``model``'s device, ``held`` as
    ``wants_hold`` decided it, without the warning: for a prompt whose end is its question
    (``generate``'s read-ahead, the benchmarks), where ranking by that end is what the policy is for."""
    if held:
        hold_rows(cache, ids.shape[0])
    with without_grad(cache):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), use_cache=True,
              logits_to_keep=1)
        if held:
            release(cache, ids.shape[1])
        if not cache.policy.ranks_by_reconstruction:
            return
        if tokenizer is None:
            raise H2OError(f"policy {cache.policy.spec!r} ranks the context by reconstructing it: "
                           f"read_context needs the tokenizer")
        if start is None:
            start = chat_head_length(tokenizer, ids[0].tolist())
        reconstruct(model, cache, ids, tokenizer, start=start)


def chat_head_length(tokenizer, ids: list[int]) -> int:
    """How many of ``ids``' first tokens are the chat template's head (its system turn and the
    user turn's opening), 0 when they do not start with it."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    try:
        head = encode_text(tokenizer, chat_frame(tokenizer)[0])
    except H2OError:  # a template that rewrites the message: no head to skip
        return 0
    return len(head) if head and len(head) < len(ids) and ids[:len(head)] == head else 0


# -- the probe call inside a layer (SlotLayer's probe route) -------------------------------------
def probe_attention(layer, query, key_new, value_new, scaling: float, block: int, reduce: str = "max",
                    span: tuple[int, int, int] | None = None):
    """``(out [B, Hq, n, Dv], best [B, Hkv, cap])`` of a probe call over ``layer``'s live slots:
    ``best`` is each slot's largest probability from any probe query of its KV head's group
    (KVzip's), or with ``reduce="sum"`` their sum (SnapKV's window mass: the streamed prefill's
    ranking, ``core/streamed.py``). ``span`` ``(head, first, stop)``: the probabilities scored are
    a second softmax over the slots of prompt positions ``[first, stop)``, the first ``head`` and
    the sinks, and the probe itself (``kvzip:local=1``); ``out`` is the whole attention's."""
    b, hq, n, d = query.shape
    hkv, cap = key_new.shape[1], layer.capacity
    g = hq // hkv
    held_keys, held_values = layer.kv()
    keys = torch.cat([held_keys, key_new], dim=2)
    values = torch.cat([held_values, value_new], dim=2)
    live = layer.valid[:, :, None, :]  # [B, Hkv, 1, cap]
    scored = None
    if span is not None:
        head, first, stop = span
        ordinal = layer.ordinal[:, :, None, :]
        scored = live & ((ordinal < max(head, layer.config.policy.sink_tokens)) | ((ordinal >= first) & (ordinal < stop)))
    block = max(1, min(block, probe_block_bytes(query.device) // (4 * b * hq * (cap + n))))
    every_slot_live = bool(layer.valid.all())  # a probe on a prompt read whole: only its own tokens are masked
    best = torch.zeros(b, hkv, cap, dtype=torch.float32, device=query.device)
    outputs = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        m = stop - start
        q = query[:, :, start:stop].reshape(b, hkv, g * m, d)  # query head kv*g + j serves KV head kv
        logits = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling).view(b, hkv, g, m, cap + n)
        sees_new = torch.arange(n, device=query.device) <= torch.arange(start, stop, device=query.device)[:, None]
        if every_slot_live:
            logits[..., cap:].masked_fill_(~sees_new, float("-inf"))
        else:
            allowed = torch.cat([live.expand(b, hkv, m, cap), sees_new.expand(b, hkv, m, n)], dim=-1)
            logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        scores = probs
        if scored is not None:  # the same logits, normalized over the chunk the call repeats
            mine = torch.cat([scored.expand(b, hkv, m, cap), sees_new.expand(b, hkv, m, n)], dim=-1)
            scores = torch.softmax(logits.masked_fill(~mine[:, :, None], float("-inf")), dim=-1)
        if reduce == "sum":
            best += scores[..., :cap].sum(dim=(2, 3))
        else:
            best = torch.maximum(best, scores[..., :cap].amax(dim=(2, 3)))
        out = torch.matmul(probs.view(b, hkv, g * m, cap + n).to(values.dtype), values)
        outputs.append(out.view(b, hq, m, values.shape[-1]))
    return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0], best


def check_probe_call(new_mask, sliding_window) -> None:
    """A probe has no padding (every row reads the same probe) and no sliding window."""
    if new_mask is not None and not bool(new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1).all()):
        raise H2OError("a reconstruction probe cannot be padded: every row's prompt must have the same length")
    if sliding_window is not None:
        raise H2OError("reconstruction (kvzip) does not support models with sliding-window attention")
