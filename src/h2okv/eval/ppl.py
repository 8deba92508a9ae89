"""``h2okv eval ppl``: streaming perplexity with the cache evicting while it reads.

Every prediction is shaped by eviction: the text goes through ONE forward call with
``H2OCache(..., chunk_size=1)``, so each query attends only to the tokens its cache still holds at
that step and eviction follows every token (Algorithm 1). That is the same computation as a
token-by-token decode loop (``tests/eval/test_ppl.py`` checks the logits match), at the cost of one
forward.

A budget ``b`` is ``heavy_ratio = recent_ratio = b/2`` of the scored text length
(``BudgetSpec.from_fraction``; the paper's "20% cache" is 0.1 + 0.1). ``full`` is the reference; it never evicts, so it is run with the default
chunked prefill, which gives the same logits as ``chunk_size=1``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from h2okv.core.attention import attention_modules
from h2okv.eval.plots import new_figure, policy_color, save_figure
from h2okv.eval.scoring import perplexity, streaming_nll
from h2okv.policies import policy_class
from h2okv.settings import DEFAULT_KV_GROUP, slot_coding_keywords


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
    kv_bits: int | None = None  # quantized slots (the reference, full, is always the model's dtype)
    kv_group: int | None = None
    key_bits: int | None = None  # the keys', where not kv_bits
    float_window: int | None = None  # quantized rows' last tokens also kept in float
    center_keys: bool | None = None  # quantized rows' keys coded less their channel's turned mean

    @property
    def label(self) -> str:
        if self.kv_bits is None:
            return self.policy
        coding = f"{self.kv_bits}-bit" if self.key_bits in (None, self.kv_bits) else f"k{self.key_bits}v{self.kv_bits}"
        coding += " centered" if self.center_keys else ""
        return f"{self.policy} {coding}" + (f" +{self.float_window} float" if self.float_window else "")


def after_fill(nll: torch.Tensor, slots: int) -> torch.Tensor:
    # step t writes token t, attends, then evicts once t + 1 > slots: the first query that attends
    # over an evicted set is t = slots + 1, and nll[:, t] is the prediction made by query t
    return nll[:, slots + 1 :]


def ppl_grid(
    model, ids: torch.Tensor, policies: list[str], budgets: list[float], seed: int = 0, progress=True,
    kv_bits: tuple = (None,), coding: dict | None = None,
) -> tuple[list[PplRow], float]:
    """Rows for ``full`` (always measured: it is the reference) and each evicting policy x budget,
    once per ``kv_bits`` (None: the model's dtype; a number: quantized slots, ``full``'s too, which
    is quantization alone); returns ``(rows, full_ppl)``. The float ``full`` is listed only if it is
    in ``policies``. ``coding``: the quantized rows' other keywords (``kv_group``; ``key_bits``, the
    keys' bits, None: each row's kv_bits; ``float_window``; ``center_keys``)."""
    coding = coding or {}
    kv_group, key_bits = coding.get("kv_group") or DEFAULT_KV_GROUP, coding.get("key_bits")
    float_window, center_keys = coding.get("float_window") or 0, bool(coding.get("center_keys"))
    segments, tokens = ids.shape
    evicting = [p for p in policies if policy_class(p).evicts]
    n_layers = len({i for i, _ in attention_modules(model)})
    runs = [("full", None, None)] + [("full", None, bits) for bits in kv_bits if bits is not None]
    runs += [(p, b, bits) for bits in kv_bits for p in evicting for b in budgets]
    rows: list[PplRow] = []
    with tqdm(total=len(runs) * n_layers, desc="ppl", unit="layer", disable=not progress) as bar, layer_progress(model, bar):
        full_nll = None
        for policy, budget, bits in runs:
            keys = None if bits is None else key_bits
            bar.set_postfix_str((policy if budget is None else f"{policy}@{budget:g}") + (f" {bits}-bit" if bits else ""))
            start = time.perf_counter()
            keywords = slot_coding_keywords(bits, kv_group, keys, float_window if bits is not None else 0,
                                            center_keys and bits is not None)
            nll, slots = streaming_nll(model, ids, policy, budget, seed, **keywords)
            seconds = time.perf_counter() - start
            if full_nll is None:
                full_nll, full_ppl = nll, perplexity(nll)
            slots = tokens if slots is None else slots
            ppl = perplexity(nll)
            tail = after_fill(nll, slots)
            tail_ppl = perplexity(tail) if tail.numel() else None
            tail_full = perplexity(after_fill(full_nll, slots)) if tail.numel() else None
            if policy == "full" and bits is None and "full" not in policies:
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
                    kv_bits=bits,
                    kv_group=None if bits is None else kv_group,
                    key_bits=keys,
                    float_window=(float_window or None) if bits is not None else None,
                    center_keys=(center_keys or None) if bits is not None else None,
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
    series = list(dict.fromkeys(r.label for r in rows if r.label != "full"))  # a quantized full is a point at 100%
    for label in series:
        points = sorted((r.budget, r.ppl) for r in rows if r.label == label)
        budgets = [b * 100 for b, _ in points]
        policy = label.split(" ")[0]
        style = dict(marker="o" if label == policy else "s", label=label, color=policy_color(policy),
                     linestyle="-" if label == policy else ":")
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
