"""Output processing: from one request's next-token logits to what its client is told.

Per request, an ``Output`` holds the request's own seeded generator (``choose`` samples a step's
rows together, each with its own: ``sampling.py``), records its tokens (and their logprobs when
asked), and decides whether the generation ends (EOS, a stop string, ``max_tokens``) and which text
is safe to send (``text.py``). It turns that into what the engine pushes to the request's
``Handle``. A *plain* request (no stop strings, no logprobs) needs no text to decide anything: its
output hands on its token ids and a ``TextEnd``, and its handle decodes them where the client takes
them (``types.Handle``), out of the engine's step, as vLLM's output processor detokenizes outside
its engine core. A request with stop strings is decoded in the step: whether it goes on depends on
its text, and a row that fed a token past its stop would leave a cache (the prefix store's saved
state) that no longer matches what it answered. ``sampling.py`` and ``text.py`` stay modules of
their own: each is one rule (how to pick a token; which decoded text may leave) with tests of its
own, and this module is the per-token decision that uses both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2okv.serve.sampling import GREEDY_BELOW, INVALID, argmax_ids, make_generator, sample_batch
from h2okv.serve.text import TextStream
from h2okv.serve.types import Event, GenerationRequest, TextEnd, TokenLogprob


class Output:
    """What one request has generated so far, and the events it still owes its client."""

    def __init__(self, request: GenerationRequest, decode: Callable[[list[int]], str], device):
        self.request = request
        self.generated: list[int] = []
        self.generator = make_generator(request.seed, device)
        self.text = TextStream(decode, request.stops)
        # no stop strings, no logprobs: its text is decoded by its handle, not in the engine's step
        self.plain = not request.stops and request.top_logprobs is None
        self.logprobs: list[TokenLogprob] = []  # not yet handed out
        self.cached_tokens = 0  # prompt tokens resumed from the prefix store, not read again

    def record(self, token: int) -> None:
        """Take ``token`` (this request's choice from ``choose``) as the next generated one."""
        if token == INVALID:
            raise ValueError("the next-token probabilities contain nan (an inf or nan logit)")
        self.generated.append(token)

    def emit(self, token: int, eos_ids: set[int], logits: torch.Tensor | None = None) -> Event | TextEnd | int | None:
        """What ``token`` (just chosen from ``logits``, this request's row, needed only when it asks
        for logprobs, and recorded) gives its handle: the final event (an ``Event`` ``"done"``, a
        ``TextEnd`` for a plain request) when the generation ends here; else, for a plain request,
        the token itself, whose text its handle decodes; for another, a ``"text"`` event when text
        is safe to send, None while it is held back. A plain request's token that ends nothing
        gives the token: the engine's step hands those on without asking (``Engine._decoded``)."""
        req = self.request
        if self.plain:
            if token in eos_ids and not req.ignore_eos:
                return self.finish("stop")
            if len(self.generated) >= req.max_tokens:
                return self.finish("length", (token,))
            return token
        if req.top_logprobs is not None:
            self.logprobs.append(logprob_of(logits, token, req.top_logprobs))
        if token in eos_ids and not req.ignore_eos:
            return self.done(self.text.flush(), "stop")
        piece, stopped = self.text.push(token)
        if stopped:
            return self.done(piece, "stop")
        if len(self.generated) >= req.max_tokens:
            return self.done(piece + self.text.flush(), "length")
        if piece:
            return Event("text", piece, logprobs=None if req.top_logprobs is None else self._take_logprobs())
        return None

    def done(self, text: str, reason: str) -> Event:
        """The final event, with ``text`` (what is left to send) and the usage."""
        prompt = len(self.request.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                 "total_tokens": prompt + len(self.generated),
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        return Event("done", text, finish_reason=reason, usage=usage, token_ids=list(self.generated),
                     logprobs=self._take_logprobs())

    def finish(self, reason: str, ids: tuple[int, ...] = ()) -> TextEnd:
        """A plain request's final event: its text (``ids``', then what its stream held back) is
        its handle's to add."""
        return TextEnd(self.done("", reason), ids)

    def end(self, reason: str) -> Event | TextEnd:
        """End now (e.g. ``"timeout"``) with what was generated so far."""
        return self.finish(reason) if self.plain else self.done(self.text.flush(), reason)

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if self.request.top_logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken


def choose(outputs: list[Output], logits: torch.Tensor) -> list[int]:
    """The next token of each request: row ``i`` of ``logits`` ``[rows, vocab]`` is ``outputs[i]``'s
    (sampled together: one copy to the host for the step)."""
    temperatures = [o.request.temperature for o in outputs]
    if max(temperatures) < GREEDY_BELOW:  # every row greedy: what sample_batch gives, without its per-row pass
        return argmax_ids(logits)
    return sample_batch(logits, temperatures, [o.request.top_p for o in outputs], [o.generator for o in outputs])


def logprob_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """Log-probabilities under the model's distribution (before temperature and top-p, as OpenAI's)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if k:
        values, ids = logp.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), top)


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a generation: the tokenizer's EOS and the model's generation config's."""
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
