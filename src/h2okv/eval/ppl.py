"""``h2okv eval ppl``: streaming perplexity with the cache evicting while it reads.

Every prediction is shaped by eviction: the text goes through ONE forward call with
``H2OCache(..., chunk_size=1)``, so each query attends only to the tokens its cache still holds at
that step and eviction follows every token (Algorithm 1). That is the same computation as a
token-by-token decode loop (``tests/test_eval_ppl.py`` checks the logits match), at the cost of one
forward.

A budget ``b`` is ``heavy_ratio = recent_ratio = b/2`` of the scored text length (the paper's "20%
cache" is 0.1 + 0.1). ``full`` is the reference; it never evicts, so it is run with the default
chunked prefill, which gives the same logits as ``chunk_size=1``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..attention import attention_modules
from ..cache import DEFAULT_CHUNK, H2OCache
from ..commands.common import add_model_args, positive_int
from ..corpus import DEFAULT_PLAY, read_play, read_text_source
from ..errors import H2OError
from ..models import load_model
from ..plots import check_output_paths, format_table, new_figure, policy_color, save_figure, write_json
from ..policies import POLICIES

DEFAULT_POLICIES = "full,h2o,local,sink,random"
DEFAULT_BUDGETS = "0.05,0.1,0.2,0.5"
DEFAULT_PLOT = "results/ppl_vs_budget.png"


# -- parsing the user's lists ---------------------------------------------------------------------
def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise H2OError("--policies is empty; give e.g. full,h2o,local")
    for name in names:
        if name not in POLICIES:
            raise H2OError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def parse_budgets(text: str) -> list[float]:
    """Comma-separated cache budgets as fractions of the text, each in (0, 1]."""
    budgets = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise H2OError(f"budget {part!r} is not a number; give fractions like 0.1,0.2") from None
        if not (0.0 < value <= 1.0):
            raise H2OError(f"budget {part} must be a fraction of the text in (0, 1]")
        budgets.append(value)
    if not budgets:
        raise H2OError("--budgets is empty; give fractions like 0.1,0.2")
    return sorted(set(budgets))


# -- CPU threads --------------------------------------------------------------------------------
def add_threads_arg(parser, default: int = 1) -> None:
    parser.add_argument(
        "--threads", type=positive_int, default=default,
        help=f"CPU threads for torch (default: {default}); the per-token steps are tiny ops where extra threads cost more than they give",
    )


def apply_threads(threads: int | None) -> None:
    # Measured on the 2-core dev machine (shared with other jobs): a 512-token streaming pass with
    # h2o took 12.7 s with 1 thread and 137 s with 2, because each of the 512 x 30 layer steps is a
    # handful of microsecond-sized ops and OpenMP's synchronisation dominates them.
    if threads:
        torch.set_num_threads(threads)


# -- where the text comes from (shared with ``h2okv analyze``) ------------------------------------
def add_text_args(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--text", default=None, help="a UTF-8 text file to score")
    group.add_argument(
        "--corpus", default=None, help=f"shakespeare:NAME, a play of the offline corpus (default: shakespeare:{DEFAULT_PLAY})"
    )
    group.add_argument("--dataset", default=None, help="Hugging Face dataset id[:config] (or local dataset folder); its text column is joined")
    parser.add_argument("--split", default=None, help="dataset split (default: test if present, else the first)")


def load_dataset_text(spec: str, split: str | None = None, column: str = "text") -> str:
    """Join the ``text`` column of a Hugging Face dataset (``id`` or ``id:config``)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is installed with lm-eval
        raise H2OError("--dataset needs the 'datasets' package: pip install datasets") from None
    name, _, config = spec.partition(":")
    try:
        loaded = datasets.load_dataset(name, config or None)
    except Exception as exc:  # the hub and the file loaders raise many types; the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise H2OError(f"cannot load dataset {spec!r}: {first}") from None
    if split is None:
        split = "test" if "test" in loaded else next(iter(loaded))
    if split not in loaded:
        raise H2OError(f"dataset {spec!r} has no split {split!r}; it has {', '.join(loaded)}")
    part = loaded[split]
    if column not in part.column_names:
        raise H2OError(f"dataset {spec!r} has no {column!r} column; it has {', '.join(part.column_names)}")
    return "\n".join(t for t in part[column] if t)


def source_text(args) -> tuple[str, str]:
    """``(text, label)`` from ``--text`` / ``--corpus`` / ``--dataset`` (default: Hamlet)."""
    if args.text is not None:
        return read_text_source(args.text), args.text
    if args.dataset is not None:
        return load_dataset_text(args.dataset, args.split), args.dataset
    corpus = args.corpus or f"shakespeare:{DEFAULT_PLAY}"
    if not corpus.startswith("shakespeare:"):
        raise H2OError(f"--corpus must look like shakespeare:NAME, got {corpus!r} (use --text for a file)")
    return read_play(corpus.split(":", 1)[1] or DEFAULT_PLAY), corpus


def text_segments(tokenizer, text: str, tokens: int, segments: int = 1) -> torch.Tensor:
    """``[segments, tokens]`` ids: consecutive, non-overlapping windows from the start of ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = tokens * segments
    if len(ids) < need:
        raise H2OError(f"the text has {len(ids)} tokens; {segments} segment(s) of {tokens} need {need}")
    return torch.tensor(ids[:need], dtype=torch.long).view(segments, tokens)


# -- the measurement ----------------------------------------------------------------------------
def make_cache(model, policy: str, budget: float | None, seed: int = 0) -> H2OCache:
    """The cache for one streaming pass: per-token eviction for evicting policies."""
    if POLICIES[policy].evicts:
        if budget is None:
            raise H2OError(f"policy {policy!r} needs a budget")
        half = budget / 2
        return H2OCache(model, policy=policy, heavy_ratio=half, recent_ratio=half, chunk_size=1, seed=seed)
    # full keeps everything, so chunking cannot change what any query sees
    return H2OCache(model, policy=policy, chunk_size=DEFAULT_CHUNK, seed=seed)


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, N-1]`` negative log-likelihood of each next token (row by row to bound memory)."""
    rows = [F.cross_entropy(logits[b, :-1].float(), ids[b, 1:], reduction="none") for b in range(ids.shape[0])]
    return torch.stack(rows)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def streaming_nll(model, ids: torch.Tensor, policy: str, budget: float | None, seed: int = 0):
    """``(nll [B, N-1], slots)``: one teacher-forced pass with eviction applied as the text is read.

    ``slots`` is the number of tokens each (layer, head) keeps (``None`` for ``full``).
    """
    cache = make_cache(model, policy, budget, seed)
    with torch.inference_mode():
        logits = model(ids.to(model.device), past_key_values=cache, use_cache=True).logits
    budgets = cache.budget()
    return token_nll(logits, ids.to(logits.device)).cpu(), (budgets[0] if budgets else None)


@contextlib.contextmanager
def layer_progress(model, bar):
    """Advance ``bar`` once per attention layer forward: a pass over long text is slow per layer."""

    def advance(*_):  # a forward hook that returns something replaces the module's output
        bar.update(1)

    handles = [module.register_forward_hook(advance) for _, module in attention_modules(model)]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class PplRow:
    policy: str
    budget: float
    tokens: int
    segments: int
    slots: int
    ppl: float
    ppl_ratio_to_full: float
    ppl_after_fill: float | None  # only predictions made once the cache is full (eviction has happened)
    after_fill_ratio_to_full: float | None
    seconds: float


def after_fill(nll: torch.Tensor, slots: int) -> torch.Tensor:
    # step t writes token t, attends, then evicts once t + 1 > slots: the first query that attends
    # over an evicted set is t = slots + 1, and nll[:, t] is the prediction made by query t
    return nll[:, slots + 1 :]


def ppl_grid(
    model, ids: torch.Tensor, policies: list[str], budgets: list[float], seed: int = 0, progress=True
) -> tuple[list[PplRow], float]:
    """Rows for ``full`` (always measured: it is the reference) and each evicting policy x budget;
    returns ``(rows, full_ppl)``. ``full`` is listed only if it is in ``policies``."""
    segments, tokens = ids.shape
    evicting = [p for p in policies if POLICIES[p].evicts]
    n_layers = len({i for i, _ in attention_modules(model)})
    runs = [("full", None)] + [(p, b) for p in evicting for b in budgets]
    rows: list[PplRow] = []
    with tqdm(total=len(runs) * n_layers, desc="ppl", unit="layer", disable=not progress) as bar, layer_progress(model, bar):
        full_nll = None
        for policy, budget in runs:
            bar.set_postfix_str(policy if budget is None else f"{policy}@{budget:g}")
            start = time.perf_counter()
            nll, slots = streaming_nll(model, ids, policy, budget, seed)
            seconds = time.perf_counter() - start
            if full_nll is None:
                full_nll, full_ppl = nll, perplexity(nll)
            slots = tokens if slots is None else slots
            ppl = perplexity(nll)
            tail = after_fill(nll, slots)
            tail_ppl = perplexity(tail) if tail.numel() else None
            tail_full = perplexity(after_fill(full_nll, slots)) if tail.numel() else None
            if policy == "full" and "full" not in policies:
                continue  # the reference is always measured, listed only when asked for
            rows.append(
                PplRow(
                    policy=policy,
                    budget=1.0 if budget is None else budget,
                    tokens=tokens,
                    segments=segments,
                    slots=slots,
                    ppl=ppl,
                    ppl_ratio_to_full=ppl / full_ppl,
                    ppl_after_fill=tail_ppl,
                    after_fill_ratio_to_full=None if tail_ppl is None else tail_ppl / tail_full,
                    seconds=round(seconds, 2),
                )
            )
    return rows, full_ppl


# -- outputs -------------------------------------------------------------------------------------
def _plain_log_axis(ax, values) -> None:
    """Log y axis labelled with plain numbers (20, 30, 50 rather than 2 x 10^1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    # within one decade label every minor tick, over several only 2, 3 and 5 (no overlaps)
    subs = (2, 3, 4, 5, 6, 7, 8, 9) if max(values) / min(values) < 10 else (2, 3, 5)
    ax.yaxis.set_minor_locator(LogLocator(subs=subs))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot_ppl(rows: list[PplRow], full_ppl: float, path, title: str):
    """Left: perplexity vs budget per policy, full as a line. Right: the excess over full in %,
    on a symmetric-log axis, so that close policies (h2o vs sink) stay apart next to ones that
    explode (local, random)."""
    from matplotlib.ticker import FuncFormatter

    fig, axes = new_figure(ncols=2, width=5.6)
    left, right = axes[0]
    policies = list(dict.fromkeys(r.policy for r in rows if r.policy != "full"))
    for policy in policies:
        points = sorted((r.budget, r.ppl) for r in rows if r.policy == policy)
        budgets = [b * 100 for b, _ in points]
        style = dict(marker="o", label=policy, color=policy_color(policy))
        left.plot(budgets, [p for _, p in points], **style)
        right.plot(budgets, [100 * (p / full_ppl - 1) for _, p in points], **style)
    left.axhline(full_ppl, color=policy_color("full"), linestyle="--", label=f"full ({full_ppl:.2f})")
    right.axhline(0, color=policy_color("full"), linestyle="--", label="full")
    values = [r.ppl for r in rows] + [full_ppl]
    if max(values) / min(values) > 2:  # local/random explode at small budgets; keep the rest readable
        _plain_log_axis(left, values)
    right.set_yscale("symlog", linthresh=1.0)
    lowest = min(100 * (r.ppl / full_ppl - 1) for r in rows)
    right.set_ylim(bottom=min(-0.5, 1.5 * lowest))  # room below 0 only if a policy beat full
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
    for ax in (left, right):
        ax.set_xlabel("KV cache budget (% of the text's tokens kept per layer/head)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    left.set_ylabel("perplexity (lower is better)")
    right.set_ylabel("perplexity above full cache")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def register_eval(kinds) -> None:
    p = kinds.add_parser("ppl", help="streaming perplexity with the cache evicting as the text is read")
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per segment (default: 1024)")
    p.add_argument("--segments", type=positive_int, default=1, help="consecutive segments scored in one batch (default: 1)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default: {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"cache budgets as fractions of --tokens (default: {DEFAULT_BUDGETS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    add_threads_arg(p)
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"PNG of perplexity vs budget (default: {DEFAULT_PLOT})")
    p.set_defaults(func=run)


def run(args) -> int:
    policies = parse_policies(args.policies)
    budgets = parse_budgets(args.budgets)
    if args.tokens < 2:
        raise H2OError("--tokens must be at least 2 (perplexity needs a token to predict)")
    check_output_paths(args.json, args.plot)
    text, label = source_text(args)
    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    ids = text_segments(tokenizer, text, args.tokens, args.segments)
    start = time.perf_counter()
    rows, full_ppl = ppl_grid(model, ids, policies, budgets, seed=args.seed)
    total = time.perf_counter() - start

    print(f"Streaming perplexity, {args.segments} x {args.tokens} tokens of {label} (eviction after every token)")
    headers = ["policy", "budget", "slots", "ppl", "x full", "ppl after fill", "x full"]
    table = [[r.policy, r.budget, r.slots, r.ppl, r.ppl_ratio_to_full, r.ppl_after_fill, r.after_fill_ratio_to_full] for r in rows]
    print(format_table(headers, table))
    print(f"full-cache perplexity {full_ppl:.3f}; {len(rows)} rows in {total:.1f} s")
    if args.json:
        write_json([vars(r) for r in rows], args.json)
        print(f"wrote {args.json}")
    if args.plot:
        title = f"Streaming perplexity, {args.segments}x{args.tokens} tokens of {label}"
        print(f"wrote {plot_ppl(rows, full_ppl, args.plot, title)}")
    return 0
