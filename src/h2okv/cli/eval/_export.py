"""``--export-prompts``: an evaluation's prompts written for a peer to run on the same token ids."""

from __future__ import annotations


def write_export(exported: dict, path: str, what: str, model_key: str = "model") -> int:
    """Write ``exported`` (an ``export_prompts`` result; its model, under ``model_key``, is the folder
    the model was loaded from: for a built-in GGUF model, the converted checkpoint) to ``path`` and say
    so in one line: ``what`` names the prompts (``"12 prompts"``)."""
    from h2okv.eval.output import write_json

    write_json(exported, path)
    print(f"wrote {what} of {exported[model_key]} to {path}")
    return 0
