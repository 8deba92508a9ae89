"""The JSON rows of ``h2okv eval longctx`` (one per sample and configuration), with no dependency
beyond the standard library: the kvpress adapter (``tools/peer/run_kvpress.py``) loads this file by
path and writes the same rows, so any mix of files merges into one table.

A row is identified by ``row_key``: the prompts' haystack and seed (so a dev-split row and a
test-split row never stand for each other, ``splits.py``), the question mode, the configuration
(policy, budget, cache options), the task, the context length, the sample and, for several questions over one context
(``--questions-per-context N``: question mode ``reuse`` or ``fresh``), N and the question's index. A grid split across sessions writes
several files; ``merge_rows`` joins them, a later file's row replacing an earlier one's with the
same key and model (``model_name``: a 1.5B row never replaces the 0.5B's of the same cell). The key
leaves the model out because a run resumes only its own model's rows (``resume_keys``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROW_FIELDS = (
    "task", "context", "sample", "question", "policy", "budget", "cache_options", "chunk_size",
    "metric", "score", "answer", "references", "haystack", "seed", "model", "max_new_tokens", "seconds",
)


# optional: the recipe a row's policy and cache options were expanded from (h2okv.recipes); with
# several questions per context, N, which question, and the prompt tokens its mode read per context
# ``split``: dev or test (``splits.py``); what the answer cost (``runner.Costs``, per prompt of a
# batch of ``batch``): seconds to the first token and after it, the process's peak memory above
# what it held before the batch, the KV bytes held at the end as a fraction of a full cache's;
# where it ran (``device``: cpu, cuda; ``dtype``: float32, bfloat16): rows of one configuration on
# the default group of quantized slots (settings.DEFAULT_KV_GROUP, equal by a test: this file
# imports nothing of h2okv), which a label leaves out
KV_GROUP_LABELLED_BY_BITS = 32

# two devices are one cell to the resume logic, but reports tell them apart; ``settings``: the
# cache's CacheSettings as plain data (``describe()``), every keyword the recipe or defaults filled in
# ``peak_process``: "fresh" where the batch ran in a process of its own (``fresh_process.py``), so
# its ``peak_mib`` is not shaped by what the grid's process ran before it
OPTIONAL_FIELDS = ("recipe", "questions", "question_index", "prefill_tokens", "split",
                   "prefill_s", "decode_s", "peak_mib", "kv_fraction", "kv_share_16bit", "batch", "device", "dtype", "settings",
                   "peak_process")


# the options a recipe row's coding suffix names (never a departure from the recipe)
CODING_OPTIONS = ("kv_bits", "key_bits", "kv_group", "float_window", "center_keys")


def config_label(policy: str, cache_options: dict | None, recipe: str | None = None,
                 recipe_settings: dict | None = None, context: int | None = None) -> str:
    """How a configuration is named in tables and plots: a recipe by its name, else the policy
    spec, then its cache options.

    ``recipe_settings``: the recipe's keywords as they are now (``h2okv.recipes``; this file imports
    none of h2okv). A recipe row that departs from them (a row written when the recipe meant
    something else, or an option given beside it, e.g. ``prefill=chunked``) names what departs, so
    it is never one configuration with the recipe's own rows (whose cells would overwrite each other's).
    ``context``: the row's prompt length, where a policy's meaning depends on it (``ranking_at``)."""
    if recipe:
        departs = departures(policy, cache_options, recipe_settings, context)
        return f"recipe {recipe}{coding_suffix(cache_options)}{departs}"
    if not cache_options:
        return policy
    return f"{policy} [{','.join(f'{k}={v}' for k, v in sorted(cache_options.items()))}]"


def ranking_at(policy: str, context: int | None) -> str:
    """``policy`` as it ranks a prompt of ``context`` tokens: kvzip's ``probe_upto=N`` runs the
    reconstruction pass up to N tokens and its ``question_kernel`` pools (and ``words`` spans) only
    past them, so two cuts on the same side of the length rank alike (``kvzip:question=32`` and
    ``kvzip:question=32,probe_upto=2560,question_kernel=31`` at 2k; cuts 2,560 and 4,096 at 8k)."""
    name, _, spec = policy.partition(":")
    if name != "kvzip" or context is None:
        return policy
    options = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    upto = int(options.pop("probe_upto", 0))
    if not upto or context <= upto:
        # the pass ranks: the kernel pools, and word spans span, only the question's attention past the cut
        options.pop("question_kernel", None)
        if upto:
            options.pop("words", None)
    else:
        options["probe_upto"] = "below"  # past the cut: the question's attention alone
    return f"{name}:{','.join(f'{k}={v}' for k, v in sorted(options.items()))}" if options else name


def departures(policy: str, cache_options: dict | None, recipe_settings: dict | None,
               context: int | None = None) -> str:
    """`` [what differs]`` between a recipe row's policy and options and the recipe's, else empty."""
    if not recipe_settings:
        return ""
    ours = {k: v for k, v in (cache_options or {}).items() if k not in CODING_OPTIONS}
    theirs = {k: v for k, v in recipe_settings.items() if k != "policy"}
    recipe_policy = recipe_settings.get("policy", policy)
    parts = [policy] if ranking_at(policy, context) != ranking_at(recipe_policy, context) else []
    parts += [f"{k}={ours.get(k)}" for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    return f" [{' '.join(parts)}]" if parts else ""


def coding_suffix(cache_options: dict | None) -> str:
    """A recipe row's quantized slots, for its label (`` k8v4``, `` 4``, `` 4/64`` for another
    group, `` k8v4+f32`` with a float window; empty for the model's dtype): a recipe is named, not its options, so the bits must be."""
    options = cache_options or {}
    bits, keys, group = options.get("kv_bits"), options.get("key_bits"), options.get("kv_group", KV_GROUP_LABELLED_BY_BITS)
    if bits is None:
        return ""
    label = f"{bits}" if keys in (None, bits) else f"k{keys}v{bits}"
    label = label if group == KV_GROUP_LABELLED_BY_BITS else f"{label}/{group}"
    window = options.get("float_window")
    label = f"{label}+f{window}" if window else label
    return f" {label}+ck" if options.get("center_keys") else f" {label}"


def make_row(**fields) -> dict:
    missing = [f for f in ROW_FIELDS if f not in fields]
    unknown = [f for f in fields if f not in ROW_FIELDS + OPTIONAL_FIELDS]
    if missing or unknown:
        raise ValueError(f"row fields: missing {missing}, unknown {unknown}")
    row = {f: fields[f] for f in ROW_FIELDS}
    row.update({f: fields[f] for f in OPTIONAL_FIELDS if fields.get(f) is not None})
    row["cache_options"] = dict(row["cache_options"] or {})
    return row


def row_key(row: dict) -> tuple:
    options = tuple(sorted((row.get("cache_options") or {}).items()))
    return (row.get("haystack"), row.get("seed"), row["question"], row["policy"], float(row["budget"]), options,
            row["task"], int(row["context"]), int(row["sample"]), questions_of(row), int(row.get("question_index", 0)))


def questions_of(row: dict) -> int:
    """How many questions the row's context carried (1 for every row but ``--questions-per-context``'s)."""
    return int(row.get("questions", 1))


def model_name(row: dict) -> str:
    """The model a row ran, by its folder's name: a converted GGUF's folder ends in
    ``-<bytes>-transformers-<version>-v<N>``, which is left out, so rows converted under two
    transformers versions (and on two machines) name one model."""
    name = str(row.get("model") or "?").rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"-\d+-transformers-[\w.]+-v\d+$", "", name)


def merge_rows(*groups: list[dict]) -> list[dict]:
    """All rows of ``groups``, one per key and model, in first-seen order; a later duplicate wins."""
    merged: dict[tuple, dict] = {}
    for group in groups:
        for row in group:
            merged[(model_name(row), *row_key(row))] = row
    return list(merged.values())


def resume_keys(rows: list[dict], model: str) -> set[tuple]:
    """The keys of the cells ``rows`` already hold for ``model`` (a path or folder name): a file
    that also holds another model's rows keeps them, and its cells are not this model's."""
    mine = model_name({"model": model})
    return {row_key(r) for r in rows if model_name(r) == mine}


def read_rows(path: str | Path) -> list[dict]:
    """The rows of one file (``[]`` when it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "question" in r and "task" in r for r in rows):
        raise ValueError(f"{path} does not hold eval longctx rows")
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Written to a temporary file first, then renamed: an interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
