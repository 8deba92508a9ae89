"""What every evaluation command writes besides its figures: JSON rows, plain text tables, and an
early check of the output paths (figures: ``plots.py``, which alone needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from h2okv.errors import H2OError


def write_json(data, path: str | Path) -> Path:
    """``data`` (rows, or a dict of them) as indented JSON; parent folders created."""
    import json

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise H2OError(f"cannot write JSON {str(path)!r}: {exc.strerror or exc}") from None
    return path


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width text table (floats to 4 significant digits, None as '-')."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def check_output_paths(json_path: str | None, plot_path: str | None) -> None:
    """Fail before minutes of work, not after, when an output path cannot be used."""
    if plot_path and Path(plot_path).suffix.lower() != ".png":
        raise H2OError(f"--plot must end in .png, got {plot_path!r}")
    for path in (json_path, plot_path):
        if path and Path(path).is_dir():
            raise H2OError(f"output path {path!r} is a directory")
