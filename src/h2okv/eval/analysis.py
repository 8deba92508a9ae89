"""The two observations H2O rests on, measured on a model and a text:

1. attention is sparse: in most rows almost all probabilities are tiny next to the row's maximum
   (the paper reports > 95% of entries below 1% of the row max);
2. accumulated attention (what H2O ranks tokens by) is concentrated on few tokens: sorted by rank,
   it falls off like a power law, so a few "heavy hitters" carry most of it.

Full attention probabilities come from one eager forward pass (``eager_attention`` switches the
model to transformers' eager attention and restores its previous implementation afterwards); a
forward hook on each attention module reduces the layer's ``[B, H, N, N]`` probabilities to counts
and column sums at once, so memory stays at one layer's matrix whatever the depth of the model.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from h2okv.core.attention import attention_modules
from h2okv.errors import H2OError


def causal_mask(n: int, device=None) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def row_sparsity_counts(probs: torch.Tensor, threshold: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """``(below, total)`` per head for ``probs [B, H, N, N]`` of causal self-attention.

    An entry counts as sparse when it is below ``threshold`` x its row's maximum. Only entries a
    query may attend to (key <= query) are counted: the masked upper triangle is not "sparsity".
    Returns per-head tensors ``[H]``.
    """
    if probs.dim() != 4 or probs.shape[-1] != probs.shape[-2]:
        raise H2OError(f"expected square attention probabilities [B, H, N, N], got {tuple(probs.shape)}")
    n = probs.shape[-1]
    allowed = causal_mask(n, probs.device)
    probs = probs.float()
    row_max = probs.amax(dim=-1, keepdim=True)
    below = ((probs < threshold * row_max) & allowed).sum(dim=(0, 2, 3))
    total = torch.full_like(below, allowed.sum() * probs.shape[0])
    return below, total


def accumulated_attention(probs: torch.Tensor) -> torch.Tensor:
    """``[H, N]``: for each key token, the attention it received summed over queries (and batch)."""
    return probs.float().sum(dim=(0, 2))


@dataclass
class PowerLawFit:
    slope: float  # exponent of acc ~ rank^slope (negative)
    r2: float


def fit_power_law(values: torch.Tensor, skip_first: int = 1) -> PowerLawFit:
    """Least-squares line through ``log(value)`` vs ``log(rank)`` of the values sorted descending.

    The top ``skip_first`` ranks are left out of the fit: the first token is an attention sink whose
    mass is orders of magnitude above the rest and would tilt the line.
    """
    ranked = torch.sort(values.double().flatten(), descending=True).values
    ranked = ranked[ranked > 0]
    ranks = torch.arange(1, ranked.numel() + 1, dtype=torch.float64)
    x, y = ranks[skip_first:].log(), ranked[skip_first:].log()
    if x.numel() < 3:
        raise H2OError("too few tokens with attention to fit a power law")
    xm, ym = x.mean(), y.mean()
    slope = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
    residual = y - (ym + slope * (x - xm))
    r2 = 1.0 - float((residual**2).sum() / ((y - ym) ** 2).sum())
    return PowerLawFit(slope, r2)


def top_share(values: torch.Tensor, fraction: float) -> float:
    """Share of the total held by the top ``fraction`` of tokens."""
    ranked = torch.sort(values.double().flatten(), descending=True).values
    k = max(1, int(round(fraction * ranked.numel())))
    return float(ranked[:k].sum() / ranked.sum())


class AttentionRecorder:
    """Reduces each layer's attention probabilities as they are produced."""

    def __init__(self, threshold: float = 0.01):
        self.threshold = threshold
        self.below: dict[int, torch.Tensor] = {}
        self.total: dict[int, torch.Tensor] = {}
        self.accumulated: dict[int, torch.Tensor] = {}

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        below, total = row_sparsity_counts(probs, self.threshold)
        acc = accumulated_attention(probs)
        if layer in self.below:  # several batches: keep adding
            below, total, acc = below + self.below[layer], total + self.total[layer], acc + self.accumulated[layer]
        self.below[layer], self.total[layer], self.accumulated[layer] = below.cpu(), total.cpu(), acc.cpu()

    def hook(self, layer: int):
        def on_forward(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise H2OError(f"layer {layer} returned no attention probabilities under eager attention")
            self.observe(layer, weights.detach())

        return on_forward


@contextlib.contextmanager
def eager_attention(model):
    """Run ``model`` with transformers' eager attention (which returns probabilities), then restore."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
    except (ValueError, ImportError) as exc:
        raise H2OError(f"{type(model).__name__} cannot run eager attention: {exc}") from None
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@dataclass
class LayerStats:
    layer: int
    sparsity: float  # share of causal entries < threshold x row max, all heads
    min_head_sparsity: float
    max_head_sparsity: float
    powerlaw_slope: float  # fitted on accumulated attention summed over the layer's heads
    powerlaw_r2: float
    top10_share: float  # share of the accumulated attention held by the top 10% of tokens
    top20_share: float


def record_attention(model, ids: torch.Tensor, threshold: float = 0.01, progress=None) -> AttentionRecorder:
    """One eager forward over ``ids [B, N]`` with every layer's probabilities reduced on the fly."""
    recorder = AttentionRecorder(threshold)
    modules = list(attention_modules(model))
    if not modules:
        raise H2OError(f"{type(model).__name__}: found no attention modules to observe")
    handles = [module.register_forward_hook(recorder.hook(idx)) for idx, module in modules]
    if progress is not None:

        def advance(*_):  # returns None: a hook's return value would replace the module's output
            progress.update(1)

        handles += [module.register_forward_hook(advance) for _, module in modules]
    try:
        with eager_attention(model), torch.inference_mode():
            model(ids.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return recorder


def layer_stats(recorder: AttentionRecorder) -> list[LayerStats]:
    rows = []
    for layer in sorted(recorder.below):
        below, total = recorder.below[layer].double(), recorder.total[layer].double()
        per_head = below / total
        acc = recorder.accumulated[layer].sum(0)  # the layer's heads summed, [N]
        fit = fit_power_law(acc)
        rows.append(
            LayerStats(
                layer=layer,
                sparsity=float(below.sum() / total.sum()),
                min_head_sparsity=float(per_head.min()),
                max_head_sparsity=float(per_head.max()),
                powerlaw_slope=fit.slope,
                powerlaw_r2=fit.r2,
                top10_share=top_share(acc, 0.10),
                top20_share=top_share(acc, 0.20),
            )
        )
    return rows


def ranked(values: torch.Tensor) -> list[float]:
    """Values sorted descending, normalised to sum to 1 (for plotting several layers together)."""
    out = torch.sort(values.double().flatten(), descending=True).values
    total = float(out.sum())
    return (out / total).tolist() if total > 0 and not math.isnan(total) else out.tolist()


# -- figures ---------------------------------------------------------------------------------------
def plot_sparsity(rows, path, title: str, threshold: float):
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(width=7.5)
    ax = axes[0][0]
    layers = [r.layer for r in rows]
    ax.bar(layers, [100 * r.sparsity for r in rows], color="tab:red", alpha=0.8, label="all heads")
    ax.errorbar(layers, [100 * r.sparsity for r in rows],
                yerr=[[100 * (r.sparsity - r.min_head_sparsity) for r in rows],
                      [100 * (r.max_head_sparsity - r.sparsity) for r in rows]],
                fmt="none", ecolor="black", capsize=2, linewidth=0.8, label="least / most sparse head")
    ax.axhline(95, color="gray", linestyle="--", linewidth=1, label="95%")
    low = min(r.min_head_sparsity for r in rows) * 100
    ax.set_ylim(max(0.0, low - 5), 100)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"% of attention probabilities < {threshold:g} x row max")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_powerlaw(recorder, rows, path, title: str):
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(width=6.4)
    ax = axes[0][0]
    layers = sorted(recorder.accumulated)
    picks = sorted({layers[round(i * (len(layers) - 1) / 4)] for i in range(5)})  # five layers, first to last
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    slopes = {r.layer: r.powerlaw_slope for r in rows}
    for i, layer in enumerate(picks):
        values = ranked(recorder.accumulated[layer].sum(0))
        ax.loglog(range(1, len(values) + 1), values, color=cmap(i / max(len(picks) - 1, 1)),
                  label=f"layer {layer} (slope {slopes[layer]:.2f})")
    ax.set_xlabel("token rank by accumulated attention")
    ax.set_ylabel("share of the layer's accumulated attention")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
