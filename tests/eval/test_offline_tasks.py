"""lm-eval tasks read from an offline ``save_to_disk`` copy (no hub), few-shot from the same split
without the item itself. The fixture builds the copy; the olmo package is not needed."""

import json

import pytest

pytest.importorskip("lm_eval")

import datasets  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from h2okv import H2OError  # noqa: E402
from h2okv.cli import main as cli_main  # noqa: E402
from h2okv.eval import offline  # noqa: E402

TASK = "offline_toy"
N_DOCS = 12


@pytest.fixture
def offline_root(tmp_path, monkeypatch):
    """``<root>/testorg/toy/none/validation``: a validation split only, as in the olmo package."""
    root = tmp_path / "hf_datasets"
    docs = [{"question": f"question{i} is", "choices": [f"yes{i}", f"no{i}"], "label": i % 2} for i in range(N_DOCS)]
    datasets.Dataset.from_list(docs).save_to_disk(str(root / "testorg" / "toy" / "none" / "validation"))
    monkeypatch.setenv(offline.ENV_ROOT, str(root))

    def no_hub(*args, **kwargs):
        raise ConnectionError("the hub must not be asked")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    offline.install()
    yield root
    offline.uninstall()


@pytest.fixture
def task_dir(tmp_path):
    path = tmp_path / "tasks"
    path.mkdir()
    # like openbookqa's YAML: train/validation/test on the hub, test evaluated by default
    (path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: testorg/toy\ntraining_split: train\nvalidation_split: validation\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n"
    )
    return path


def load_task(task_dir):
    return TaskManager(include_path=str(task_dir), include_defaults=False).load([TASK])["tasks"][TASK]


def test_offline_copy_is_read_and_splits_are_rewritten(offline_root, task_dir):
    task = load_task(task_dir)
    assert len(list(task.eval_docs)) == N_DOCS
    assert task.config.test_split == "validation" and task.config.training_split is None
    assert offline.USED[TASK] == {"folder": str(offline_root / "testorg" / "toy" / "none"),
                                  "evaluated_split": "validation", "fewshot_split": "validation",
                                  "fewshot_excludes_item": True}


def test_fewshot_examples_come_from_the_split_but_never_the_item(offline_root, task_dir):
    task = load_task(task_dir)
    shots = 5
    # every draw over many items: lm-eval samples n + 1 and drops the item (same split as evaluated)
    for seed in range(3):
        task.set_fewshot_seed(seed)
        for i, doc in enumerate(task.eval_docs):
            context = task.fewshot_context(doc, num_fewshot=shots)
            examples = context.split("\n\n")
            assert len(examples) == shots + 1, context  # 5 solved examples + the question
            assert examples[-1] == f"question{i} is"
            assert all(f"question{i} " not in e for e in examples[:-1])
            assert all(e.startswith("question") for e in examples[:-1])


def test_find_offline_aliases_and_refusals(tmp_path):
    for path in ("piqa/plain_text/validation", "super_glue/copa/validation", "boolq/none/validation",
                 "super_glue/boolq/validation"):
        datasets.Dataset.from_list([{"x": 1}]).save_to_disk(str(tmp_path / path))
    piqa = offline.find_offline("baber/piqa", None, root=tmp_path)  # renamed on the hub; one config offline
    assert piqa.folder == tmp_path / "piqa" / "plain_text" and list(piqa.splits) == ["validation"]
    assert offline.find_offline("aps/super_glue", "copa", root=tmp_path).folder == tmp_path / "super_glue" / "copa"
    # boolq offline has other columns than lm-eval's super_glue/boolq task: never substituted
    assert offline.find_offline("aps/super_glue", "boolq", root=tmp_path) is None
    assert offline.find_offline("boolq", None, root=tmp_path) is None
    assert offline.find_offline("some/unknown", "x", root=tmp_path) is None
    assert offline.find_offline("../etc", None, root=tmp_path) is None


def test_missing_evaluation_split_is_one_clear_error(tmp_path, monkeypatch, task_dir):
    root = tmp_path / "only_train"
    datasets.Dataset.from_list([{"question": "q", "choices": ["a", "b"], "label": 0}]).save_to_disk(
        str(root / "testorg" / "toy" / "none" / "train"))
    monkeypatch.setenv(offline.ENV_ROOT, str(root))
    offline.install()
    try:
        with pytest.raises(H2OError, match=r"offline data has splits \['train'\], not 'test'"):
            load_task(task_dir)
    finally:
        offline.uninstall()


def test_tasks_command_runs_offline(offline_root, task_dir, tiny_dir, tmp_path):
    out = tmp_path / "r.json"
    code = cli_main(["eval", "tasks", "--tasks", TASK, "--include-path", str(task_dir), "--num-fewshot", "2",
                     "--policies", "full,h2o", "--model", str(tiny_dir), "--limit", "4", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["offline_data"][TASK]["evaluated_split"] == "validation"
    for policy in ("full", "h2o"):
        metrics = report["results"][policy]["tasks"][TASK]
        assert 0 <= metrics["acc"] <= 1 and 0 <= metrics["acc_norm"] <= 1 and "acc_stderr" in metrics
