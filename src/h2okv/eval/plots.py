"""Figures shared by the evaluation commands: headless (Agg) PNG figures, one colour per policy
(JSON rows and text tables: ``output.py``).

Importing pyplot is deferred to the first figure so that commands which never plot do not pay for
it, and the Agg backend is selected before pyplot is imported so no display is ever needed.
"""

from __future__ import annotations

from pathlib import Path

from h2okv.errors import H2OError

# one colour per policy everywhere, so figures can be compared side by side
POLICY_COLORS = {
    "full": "black",
    "h2o": "tab:red",
    "local": "tab:blue",
    "sink": "tab:green",
    "random": "tab:gray",
    "tova": "tab:purple",
    "h2o-sink": "tab:orange",
    "h2o-mean": "tab:olive",
    "snapkv": "tab:brown",
    "knorm": "tab:cyan",
    "rkv": "goldenrod",
    "expected": "tab:pink",
    "kvzip": "darkblue",
}


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 4.2, **kwargs):
    """``(fig, axes)``; ``width``/``height`` are per panel."""
    plt = pyplot()
    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, **kwargs)


def save_figure(fig, path: str | Path, dpi: int = 130) -> Path:
    """Write ``fig`` as PNG to ``path`` (parent folders created) and release it."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise H2OError(f"plot path must end in .png, got {str(path)!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise H2OError(f"cannot write plot {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        pyplot().close(fig)
    return path


def policy_color(policy: str) -> str | None:
    return POLICY_COLORS.get(policy.partition(":")[0])  # snapkv:window=16 is still snapkv


def annotated_heatmap(ax, values, row_labels, col_labels, vmin=0.0, vmax=1.0, fmt="{:.0%}", cmap="RdYlGn", notes=None):
    """``values[r][c]`` as coloured cells with the number written in each (and ``notes[r][c]``, a
    second smaller line, if given); NaN cells stay blank."""
    import math

    image = ax.imshow(values, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(col_labels)), labels=col_labels)
    ax.set_yticks(range(len(row_labels)), labels=row_labels)
    for r, row in enumerate(values):
        for c, value in enumerate(row):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            # white on the dark ends of the colour map, black in the light middle
            share = (value - vmin) / (vmax - vmin) if vmax > vmin else 0.5
            color = "white" if share < 0.2 or share > 0.8 else "black"
            text = fmt.format(value)
            if notes is not None and notes[r][c]:
                text += f"\n{notes[r][c]}"
            ax.text(c, r, text, ha="center", va="center", fontsize=7.5, color=color)
    return image

