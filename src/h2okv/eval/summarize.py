"""``h2okv eval summarize``: k-shot summarization with each eviction policy, scored with ROUGE.

Like the paper's XSUM / CNN-DailyMail runs: each prompt holds ``k`` solved examples (document and
summary) from the same data, never the test item, then the test document; the model writes a
summary (greedy, its first line of text) through an ``H2OCache`` whose budget is a fraction of
that prompt. ROUGE-1/2/L F-measures (``rouge-score``, stemming on) against the reference.

Data: ``--data FILE.jsonl`` with fields ``document`` and ``summary``, or in the H2O reference
code's request format (``article``: the whole 0-shot prompt "###\nArticle: ...\n\nSummarize the
above article in 1 sentence.\n", ``summary_gt``, ``stop`` ["###"], ``max_tokens``; the XSUM and
CNN/DailyMail files of the paper's runs). In that format a k-shot prompt is k other items' prompts
each followed by its reference summary, then the item's own prompt; every prompt starts with the
``###`` marker, so a model that has read the examples ends its summary by starting the next one,
and generation stops at the record's ``stop`` strings (greedy: the files' temperature 0.3 is not
used, so runs are repeatable). Or ``--dataset xsum|cnn_dailymail``
(Hugging Face hub), or ``--dataset pypi-readmes``: an offline set built from the packages installed
in this environment, the document being the start of a package's README (its PyPI long
description) and the summary its one-line PyPI ``Summary``, written by the package's authors.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from h2okv.errors import H2OError, first_line

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
# hub id, config, document field, summary field
HUB_DATASETS = {
    "xsum": ("EdinburghNLP/xsum", None, "document", "summary"),
    "cnn_dailymail": ("abisee/cnn_dailymail", "3.0.0", "article", "highlights"),
}
OFFLINE_DATASET = "pypi-readmes"

# -- data ----------------------------------------------------------------------------------------


def read_jsonl(path) -> list[dict]:
    """Records with string ``document`` and ``summary``; a bad line is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise H2OError(f"data file not found: {path}")
    records = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise H2OError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise H2OError(f"{path}:{number}: expected a JSON object with 'document' and 'summary'")
            if "article" in record and "document" not in record:
                records.append(_request_record(record, f"{path}:{number}", str(record.get("id", number))))
                continue
            for field in ("document", "summary"):
                if not isinstance(record.get(field), str) or not record[field].strip():
                    raise H2OError(f"{path}:{number}: missing or empty string field {field!r}")
            records.append({"id": str(record.get("id", number)), "document": record["document"],
                            "summary": record["summary"]})
    if not records:
        raise H2OError(f"{path}: no records")
    return records


def _request_record(record: dict, where: str, ident: str) -> dict:
    """A record in the H2O reference code's request format: the prompt is given whole."""
    for field in ("article", "summary_gt"):
        if not isinstance(record.get(field), str) or not record[field].strip():
            raise H2OError(f"{where}: missing or empty string field {field!r}")
    stop = record.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(x, str) and x for x in stop):
        raise H2OError(f"{where}: 'stop' must be a list of non-empty strings")
    max_tokens = record.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise H2OError(f"{where}: 'max_tokens' must be a positive integer")
    return {"id": ident, "prompt": record["article"], "summary": record["summary_gt"], "stop": list(stop),
            "max_tokens": max_tokens}


def load_hub_dataset(name: str, split: str = "test", limit: int | None = None, shots: int = 0) -> list[dict]:
    import datasets

    repo, config, doc_field, sum_field = HUB_DATASETS[name]
    # the test items plus a pool to draw the shots from
    take = None if limit is None else limit + max(shots, 0) * 4
    try:
        data = datasets.load_dataset(repo, config, split=split if take is None else f"{split}[:{take}]")
    except (ConnectionError, OSError, TimeoutError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise H2OError(f"could not download dataset {name!r} ({repo}; no network?): {first_line(exc)}") from None
    return [{"id": str(row.get("id", i)), "document": row[doc_field], "summary": row[sum_field]}
            for i, row in enumerate(data)]


def _clean_readme(text: str) -> str:
    """Prose of a README: code blocks, badges, HTML, tables and link targets removed."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    # images first, on the whole text: a badge's alt text may wrap onto the next line, and a badge
    # inside a link, [![alt](img)](url), would otherwise leave "alt](" behind
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)
    text = re.sub(r"\[\s*\]\([^)]*\)", " ", text)  # the link the badge sat in, now empty
    kept = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("[![", "![", "<", "|", "..", ":", "+--", "===", "---", "***", ">>>", "$ ", "pip ")):
            continue
        if re.fullmatch(r"[=\-~^*#`+]+", s):
            continue  # rst/markdown underlines
        kept.append(s.lstrip("#* ").strip())
    text = " ".join(kept)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`_+", r"\1", text)  # `text <url>`_ -> text
    text = re.sub(r"https?://\S+", " ", text)
    text = text.replace("``", "").replace("`", "").replace("**", "")
    return re.sub(r"\s+", " ", text).strip()


def installed_package_summaries(max_words: int = 150, min_words: int = 60) -> list[dict]:
    """The offline ``pypi-readmes`` set from the installed distributions, sorted by name.

    Kept when the README has at least ``min_words`` words of prose and the one-line summary (5 to
    30 words) is not copied verbatim into the kept part of the README.
    """
    seen, records = set(), []
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        name = meta.get("Name") or ""
        summary = (meta.get("Summary") or "").strip()
        body = meta.get_payload() or meta.get("Description") or ""
        key = name.lower().replace("_", "-")
        if not name or key in seen or not 5 <= len(summary.split()) <= 30:
            continue
        words = _clean_readme(str(body)).split()
        if len(words) < min_words:
            continue
        document = " ".join(words[:max_words])
        if summary.rstrip(".").lower() in document.lower():
            continue
        seen.add(key)
        records.append({"id": f"{name}=={meta.get('Version')}", "document": document, "summary": summary})
    records.sort(key=lambda r: r["id"].lower())
    if not records:
        raise H2OError("no installed package has a README long enough to build the pypi-readmes set")
    return records


# -- prompts and scores --------------------------------------------------------------------------


def _example(document: str, summary: str | None, max_doc_words: int | None) -> str:
    if max_doc_words:
        document = " ".join(document.split()[:max_doc_words])
    return f"Article: {document.strip()}\nSummary:" + (f" {summary.strip()}\n\n" if summary is not None else "")


def build_prompt(records: list[dict], index: int, shots: int, seed: int = 0,
                 max_doc_words: int | None = None) -> tuple[str, list[int]]:
    """The k-shot prompt for ``records[index]`` and the indices of its examples (never ``index``);
    the examples are drawn from the other records with a generator seeded by (seed, index)."""
    others = [i for i in range(len(records)) if i != index]
    if shots > len(others):
        raise H2OError(f"--shots {shots} needs at least {shots + 1} records, the data has {len(records)}")
    chosen = random.Random(seed * 1_000_003 + index).sample(others, shots) if shots else []
    if "prompt" in records[index]:  # the H2O request format: whole prompts, "###" between examples
        parts = [_request_example(records[i]["prompt"], records[i]["summary"]) for i in chosen]
        parts.append(_request_example(records[index]["prompt"], None))
        return "".join(parts), chosen
    parts = [_example(records[i]["document"], records[i]["summary"], max_doc_words) for i in chosen]
    parts.append(_example(records[index]["document"], None, max_doc_words))
    return "".join(parts), chosen


def _request_example(prompt: str, summary: str | None) -> str:
    """An item's prompt (it begins with the ``###`` marker) and, for an example, its summary."""
    prompt = prompt.rstrip("\n") + "\n"
    return prompt if summary is None else f"{prompt}{summary.strip()}\n\n"


def rouge_per_item(predictions: list[str], references: list[str]) -> dict[str, list[float]]:
    """ROUGE-1/2/L F-measure (0..1) of each pair, with rouge-score's Porter stemming."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    per_item: dict[str, list[float]] = {name: [] for name in ROUGE_TYPES}
    for prediction, reference in zip(predictions, references, strict=True):
        for name, score in scorer.score(reference, prediction).items():
            per_item[name].append(score.fmeasure)
    return per_item


def mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); None below 2)."""
    if not values:
        return 0.0, None
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values, mean) / math.sqrt(len(values)) if len(values) > 1 else None)


def rouge_scores(predictions: list[str], references: list[str]) -> dict:
    """Mean ROUGE-1/2/L F-measure (0..1) over pairs, and ``<name>_stderr`` (standard error of the
    mean over items, as lm-eval reports for accuracy; None for fewer than 2 pairs)."""
    out = {}
    for name, values in rouge_per_item(predictions, references).items():
        out[name], out[f"{name}_stderr"] = mean_and_stderr(values)
    return out


def fidelity(outputs: list[str], reference: list[str]) -> dict:
    """How close ``outputs`` are to the full cache's outputs: mean ROUGE-L F and exact matches.
    Identical outputs count as 1.0 even when rouge-score finds no words in them (it scores "" or
    "-----" against itself as 0)."""
    pairs = [1.0 if a == b else rouge_scores([a], [b])["rougeL"] for a, b in zip(outputs, reference, strict=True)]
    n = max(len(pairs), 1)
    return {"rougeL_vs_full": sum(pairs) / n, "same_as_full": sum(a == b for a, b in zip(outputs, reference, strict=True)) / n}


# -- running -------------------------------------------------------------------------------------


def generation_stops(records: list[dict]) -> tuple[list[str], bool]:
    """``(stops, lstrip)``: the request format's own stop strings (a multi-sentence summary may
    span lines), else the first line of text (a newline before any text does not end it)."""
    if "prompt" in records[0]:
        return sorted({s for r in records for s in r["stop"]}), True
    return ["\n"], True


def prompt_ids(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt as written (no special tokens added), or with ``chat`` in the model's
    chat template (``generate.chat_prompt_ids``)."""
    from h2okv.generation import chat_prompt_ids

    return chat_prompt_ids(tokenizer, text) if chat else tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class SummarizeSpec:
    """A summarization run: each policy at ``budget`` (a fraction of each prompt), ``shots`` solved
    examples per prompt."""

    policies: Sequence[str]
    budget: float
    shots: int
    limit: int | None = None  # summarize the first N records
    max_new_tokens: int | None = None  # None: the records' max_tokens (request format), else 64
    batch_size: int = 1
    chunk_size: int = 512
    seed: int = 0  # of the choice of examples
    max_doc_words: int | None = None  # truncate the documents in prompts
    chat: bool = False  # each prompt through the tokenizer's chat template (see ``prompt_ids``)


def summarize_policies(model, tokenizer, records: list[dict], spec: SummarizeSpec) -> dict:
    """Every policy of ``spec`` summarizes the same prompts; ROUGE against the references, and
    fidelity to the ``full`` policy's summaries where it runs."""
    from h2okv.eval.lm_eval_model import generate_batch
    from h2okv.generation import new_cache

    stops, lstrip = generation_stops(records)
    max_new_tokens = spec.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max((r.get("max_tokens") or 0 for r in records), default=0) or 64

    test = list(range(len(records) if spec.limit is None else min(spec.limit, len(records))))
    prompts, shot_ids = {}, {}
    for i in test:
        text, chosen = build_prompt(records, i, spec.shots, seed=spec.seed, max_doc_words=spec.max_doc_words)
        prompts[i] = prompt_ids(tokenizer, text, spec.chat)
        shot_ids[i] = chosen
    order = sorted(test, key=lambda i: -len(prompts[i]))
    results, predictions = {}, {}
    for policy in spec.policies:
        outputs, kept = {}, []
        start = time.perf_counter()
        for s in tqdm(range(0, len(order), spec.batch_size), desc=f"summarize [{policy}]"):
            batch = order[s : s + spec.batch_size]
            cache = new_cache(model, policy, spec.budget, chunk_size=spec.chunk_size)
            texts = generate_batch(model, tokenizer, [prompts[i] for i in batch], cache, max_new_tokens,
                                   stops=stops, lstrip=lstrip)
            for i, text in zip(batch, texts, strict=True):
                outputs[i] = text.strip()
            budgets = cache.budget()
            kept.extend(budgets if budgets else [len(prompts[i]) for i in batch])
        seconds = time.perf_counter() - start
        scores = rouge_scores([outputs[i] for i in test], [records[i]["summary"] for i in test])
        results[policy] = {**scores, "items": len(test), "seconds": round(seconds, 1),
                           "mean_kv_slots": round(sum(kept) / max(len(kept), 1), 1)}
        predictions[policy] = outputs
    if "full" in predictions:
        # fidelity to the full cache, apart from the model's own quality: how much eviction
        # changed what was written
        reference = [predictions["full"][i] for i in test]
        for policy in spec.policies:
            results[policy].update(fidelity([predictions[policy][i] for i in test], reference))
    samples = [
        {"id": records[i]["id"], "shots": [records[j]["id"] for j in shot_ids[i]], "prompt_tokens": len(prompts[i]),
         "reference": records[i]["summary"], "predictions": {p: predictions[p][i] for p in spec.policies}}
        for i in test
    ]
    mean_prompt = sum(len(prompts[i]) for i in test) / max(len(test), 1)
    return {"results": results, "mean_prompt_tokens": round(mean_prompt, 1), "samples": samples}


def rouge_bars(ax, results: dict[str, dict]) -> None:
    """On ``ax``: a group of bars per ROUGE type that every policy has, a bar per policy (x100, ±
    ``<type>_stderr``), in the policy colours of the other figures."""
    from h2okv.eval.plots import policy_color

    names = [m for m in ROUGE_TYPES if all(m in metrics for metrics in results.values())]
    width = 0.8 / max(len(results), 1)
    for k, (policy, metrics) in enumerate(results.items()):
        xs = [j + (k - (len(results) - 1) / 2) * width for j in range(len(names))]
        values = [100 * metrics[m] for m in names]
        errors = [100 * (metrics.get(f"{m}_stderr") or 0) for m in names]
        bars = ax.bar(xs, values, width, yerr=errors, capsize=2, label=policy, color=policy_color(policy))
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(names)), [m.replace("rouge", "ROUGE-").upper() for m in names])
    ax.set_ylabel("F-measure (x100), ± stderr")
    ax.legend(fontsize=8)


def plot_rouge(results: dict, path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    rouge_bars(ax, results)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(results: dict) -> str:
    lines = [f"{'policy':<8} {'ROUGE-1':>8} {'ROUGE-2':>8} {'ROUGE-L':>8} {'R-L vs full':>11} {'KV slots':>9} {'seconds':>8}"]
    for policy, r in results.items():
        vs_full = f"{100 * r['rougeL_vs_full']:11.2f}" if "rougeL_vs_full" in r else f"{'-':>11}"
        lines.append(f"{policy:<8} {100 * r['rouge1']:8.2f} {100 * r['rouge2']:8.2f} {100 * r['rougeL']:8.2f} "
                     f"{vs_full} {r['mean_kv_slots']:9.1f} {r['seconds']:8.1f}")
    return "\n".join(lines)


def load_records(data: str | None = None, dataset: str | None = None, split: str = "test",
                 limit: int | None = None, shots: int = 0) -> tuple[list[dict], str]:
    """``(records, source)`` from a JSONL file, the offline set or a hub dataset."""
    if data:
        return read_jsonl(data), data
    if dataset == OFFLINE_DATASET:
        return installed_package_summaries(), OFFLINE_DATASET
    return load_hub_dataset(dataset, split, limit, shots), f"{dataset}:{split}"
