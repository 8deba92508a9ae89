"""The lm-eval model type ``h2okv`` and ``h2okv eval tasks``, on a tiny random Llama (offline)."""

import json
import random
import re

import pytest
import torch

from h2okv.core.compat import cache_arg

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from h2okv import H2OCache, H2OError  # noqa: E402
from h2okv.cli import main as cli_main  # noqa: E402
from h2okv.eval import tasks as tasks_mod  # noqa: E402
from h2okv.eval.lm_eval_model import DEFAULT_MAX_GEN_TOKS, H2OLM, LMOptions, cut_at_stops  # noqa: E402
from h2okv.tools.tiny import VOCAB, tiny_model, word_tokenizer, words  # noqa: E402

TASK = "toy_mc"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # per-token scoring runs thousands of tiny ops: on a shared machine the intra-op pool only adds
    # waiting (measured 3 s -> 0.08 s for one tiny forward)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), word_tokenizer()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    with (path / f"{TASK}.jsonl").open("w") as fh:
        for _ in range(6):
            doc = {"context": words(rng, rng.randint(20, 40)), "choices": [words(rng, 3) for _ in range(4)],
                   "label": rng.randint(0, 3)}
            fh.write(json.dumps(doc) + "\n")
    (path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(path / f'{TASK}.jsonl'))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return path


def choice_logprobs(result):
    return torch.tensor([[r[0][0] for r in s["resps"]] for s in result["samples"][TASK]])


def test_registered_without_hiding_builtin_models():
    assert get_model("h2okv") is H2OLM
    assert get_model("hf").__name__ == "HFLM"  # registering ours must not stop lm-eval's lazy table


def test_simple_evaluate_scores_with_eviction(tiny_dir, task_dir):
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)

    def run(args):
        return lm_eval.simple_evaluate(model="h2okv", model_args=f"pretrained={tiny_dir},{args},batch_size=3",
                                       tasks=[TASK], task_manager=manager, bootstrap_iters=0)

    full, tiny_budget, big_budget = run("policy=full"), run("policy=h2o,heavy=2,recent=2"), run("policy=h2o,heavy=100,recent=100")
    assert full["results"][TASK]["sample_len"] == 6
    assert 0.0 <= full["results"][TASK]["acc,none"] <= 1.0
    lp_full, lp_tiny, lp_big = map(choice_logprobs, (full, tiny_budget, big_budget))
    assert lp_full.shape == (6, 4)
    assert torch.allclose(lp_big, lp_full, atol=1e-4)  # budget >= length: nothing evicted
    assert (lp_tiny - lp_full).abs().max() > 1e-2  # a 4-token cache changes what the model reads


def requests_for(rng, n):
    return [(None, [0] + [rng.randint(2, VOCAB - 3) for _ in range(rng.randint(8, 30))],
             [rng.randint(2, VOCAB - 3) for _ in range(rng.randint(1, 4))]) for _ in range(n)]


def reference_loglik(model, context, continuation, cache=None):
    ids = torch.tensor([context + continuation[:-1]])
    logits = model(ids, **cache_arg(cache), use_cache=cache is not None).logits[0, -len(continuation):]
    lp = torch.log_softmax(logits.float(), -1)
    return float(lp.gather(-1, torch.tensor(continuation)[:, None]).sum())


def test_per_token_eviction_per_row_budget_and_batching(tiny):
    model, tok = tiny
    reqs = requests_for(random.Random(1), 7)
    lm_batched = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", heavy_ratio=0.2, recent_ratio=0.1, batch_size=4)
    lm_single = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", heavy_ratio=0.2, recent_ratio=0.1, batch_size=1)
    batched = lm_batched._loglikelihood_tokens(reqs, disable_tqdm=True)
    single = lm_single._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (a, _), (b, _), (_, ctx, cont) in zip(batched, single, reqs, strict=True):
        # left padding and the batch neighbours change nothing: each row has its own budget
        assert a == pytest.approx(b, abs=1e-4)
        # exactly one per-token H2O cache over this request's own tokens, the budget a fraction
        # of its context (branch scoring resolves the ratio when the context is read)
        cache = H2OCache(model, policy="h2o", heavy=max(1, int(0.2 * len(ctx))), recent=max(1, int(0.1 * len(ctx))),
                         chunk_size=1)
        assert a == pytest.approx(reference_loglik(model, ctx, cont, cache), abs=1e-4)
    full = H2OLM(pretrained=model, tokenizer=tok, policy="full", batch_size=4)._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (a, greedy), (_, ctx, cont) in zip(full, reqs, strict=True):
        assert a == pytest.approx(reference_loglik(model, ctx, cont), abs=1e-4)  # plain model, no cache
        assert isinstance(greedy, bool)
    assert max(abs(a[0] - b[0]) for a, b in zip(full, batched, strict=True)) > 1e-3


def test_loglikelihood_rolling(tiny):
    model, tok = tiny
    rng = random.Random(2)
    text = words(rng, 40)
    ids = tok.encode(text, add_special_tokens=False)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    lm = H2OLM(pretrained=model, tokenizer=tok, policy="full")
    # one window: log p(t_1..t_n | <s>) from the plain model
    assert lm.loglikelihood_rolling([request], disable_tqdm=True)[0] == pytest.approx(
        reference_loglik(model, [tok.bos_token_id], ids), abs=1e-3)
    windowed = H2OLM(pretrained=model, tokenizer=tok, policy="full", max_length=16)
    evicting = H2OLM(pretrained=model, tokenizer=tok, policy="local", heavy=2, recent=2, max_length=16)
    a = windowed.loglikelihood_rolling([request], disable_tqdm=True)[0]
    b = evicting.loglikelihood_rolling([request], disable_tqdm=True)[0]
    assert a < 0 and b < 0 and abs(a - b) > 1e-3


def test_generate_until_honours_until_and_max_gen_toks(tiny):
    model, tok = tiny
    rng = random.Random(3)
    contexts = [words(rng, rng.randint(5, 20)) for _ in range(3)]
    lm = H2OLM(pretrained=model, tokenizer=tok, policy="full", batch_size=2)

    def gen(lm, until, max_gen_toks):
        reqs = [Instance(request_type="generate_until", doc={}, arguments=(c, {"until": until, "max_gen_toks": max_gen_toks}),
                         idx=0) for c in contexts]
        return lm.generate_until(reqs, disable_tqdm=True)

    free = gen(lm, [], 12)
    # the reference: greedy generation with the model's own cache, one prompt at a time
    for context, text in zip(contexts, free, strict=True):
        ids = torch.tensor([tok.encode(context)])
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
        assert len(text.split()) <= 12
    # stop at a word the free run produced: everything before it, nothing after
    stop = free[0].split()[4]
    stopped = gen(lm, [stop], 12)
    for text, reference in zip(stopped, free, strict=True):
        assert stop not in text.split()
        assert text == cut_at_stops(reference, [stop])
    assert all(len(t.split()) <= 3 for t in gen(lm, [], 3))
    big = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", heavy=100, recent=100, batch_size=2)
    assert gen(big, [], 12) == free


@pytest.mark.parametrize(
    "args, message",
    [
        ({"policy": "bogus"}, "unknown policy 'bogus'"),
        ({"policy": "h2o", "heavy_ratio": 1.5, "recent_ratio": 0.1}, "heavy_ratio= must be a fraction of the prompt in"),
        ({"policy": "h2o", "heavy_ratio": "lots"}, "heavy_ratio='lots' is not a valid float"),
        ({"policy": "full", "heavy_ratio": 0.1}, "keeps every token; do not give it heavy_ratio="),
        ({"policy": "h2o", "chunk_size": 0}, "chunk_size must be >= 1"),
        ({"policy": "h2o", "bogus_arg": 1}, "unknown model_args for h2okv: bogus_arg"),
    ],
)
def test_bad_model_args_fail_before_loading(args, message):
    # pretrained points nowhere: the settings must be rejected before any model load is tried
    with pytest.raises(H2OError, match=re.escape(message)):
        H2OLM(pretrained="/nonexistent/model", **args)


def test_bad_model_args_from_arg_string():
    with pytest.raises(H2OError, match="unknown policy"):
        get_model("h2okv").create_from_arg_string("pretrained=/nonexistent,policy=lru")


def test_model_args_strings_parse_into_options():
    # lm-eval hands every model_arg over as a string, and its command line adds max_batch_size
    options = LMOptions.parse({"policy": "h2o", "budget": "0.2", "chunk_size": "4", "gen_chunk_size": "64",
                               "batch_size": "auto:4", "max_length": "128", "max_gen_toks": "", "seed": "3",
                               "max_batch_size": None})
    assert options.cache_kwargs == {"policy": "h2o", "budget": 0.2, "budget_floor": 0}
    assert options.settings.budget == 0.2 and options.settings.budget_floor == 0
    assert (options.chunk_size, options.gen_chunk_size, options.batch_size, options.max_length, options.max_gen_toks,
            options.seed) == (4, 64, 8, 128, DEFAULT_MAX_GEN_TOKS, 3)
    assert LMOptions.parse({"budget": "256"}).settings.budget == 256  # no point: slots
    parts = LMOptions.parse({"heavy": "3", "recent": "2"}).cache_kwargs
    assert parts == {"budget_floor": 0, "heavy": 3, "recent": 2}
    with pytest.raises(H2OError, match=re.escape("model_args max_length='long' is not a valid int")):
        LMOptions.parse({"max_length": "long"})  # before the model loads, as every other value


def test_shakespeare_items_are_deterministic_and_honest():
    items = tasks_mod.shakespeare_next_line_items(n_items=24, seed=0)
    assert items == tasks_mod.shakespeare_next_line_items(n_items=24, seed=0)
    assert items != tasks_mod.shakespeare_next_line_items(n_items=24, seed=1)
    assert len(items) == 24
    for item in items:
        play_lines = [line.strip() for line in tasks_mod.read_play(item["play"]).splitlines()]
        answer = item["choices"][item["label"]]
        number = int(item["id"].split(":")[1]) - 1
        assert play_lines[number] == answer  # the answer is the line at that place in the play
        # ... and the context is what precedes it (blank lines dropped)
        before = [line for line in play_lines[:number] if line][-12:]
        assert item["context"] == "\n".join(before) + "\n"
        assert len(set(item["choices"])) == 4
        assert all(c in play_lines for c in item["choices"])  # distractors from the same play


def test_tasks_command_on_local_task(tiny_dir, task_dir, tmp_path, capsys):
    out = tmp_path / "tasks.json"
    code = cli_main(["eval", "tasks", "--tasks", TASK, "--policies", "full,h2o", "--budget", "0.2",
                     "--include-path", str(task_dir), "--model", str(tiny_dir), "--batch-size", "4",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for policy in ("full", "h2o"):
        assert 0.0 <= report["results"][policy]["tasks"][TASK]["acc"] <= 1.0
        picked = report["results"][policy]["picked"][TASK]
        assert len(picked) == 6 and all(0 <= p < 4 for p in picked)
    assert report["results"]["full"]["tasks"][TASK]["agree_with_full"] == 1.0
    h2o = report["results"]["h2o"]
    same = sum(a == b for a, b in zip(h2o["picked"][TASK], report["results"]["full"]["picked"][TASK])) / 6
    assert h2o["tasks"][TASK]["agree_with_full"] == pytest.approx(same)
    table = capsys.readouterr().out
    assert TASK in table and "full" in table and "h2o" in table


def test_run_tasks_writes_the_builtin_task_for_the_run(tiny_dir):
    spec = tasks_mod.TasksSpec([tasks_mod.SHAKESPEARE_TASK], ["full"], 0.2, model=str(tiny_dir), limit=2, batch_size=2)
    results = tasks_mod.run_tasks(spec, local_items=8)
    assert results["full"]["tasks"][tasks_mod.SHAKESPEARE_TASK]["items"] == 2
    assert len(results["full"]["picked"][tasks_mod.SHAKESPEARE_TASK]) == 2


def test_tasks_command_offline_dataset_is_one_line(tmp_path, monkeypatch, capsys):
    import datasets

    (tmp_path / "hubtask.yaml").write_text(
        "task: hubtask\ndataset_path: some-org/some-dataset\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: q\ndoc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'some-org/some-dataset' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    code = cli_main(["eval", "tasks", "--tasks", "hubtask", "--include-path", str(tmp_path), "--json",
                     str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("h2okv: error: could not download the dataset of task 'hubtask'")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_tasks_command_bad_inputs(tmp_path, capsys):
    assert cli_main(["eval", "tasks", "--tasks", "copa", "--policies", "full,lru", "--json", str(tmp_path / "x")]) == 2
    assert "unknown policy 'lru'" in capsys.readouterr().err
    assert cli_main(["eval", "tasks", "--tasks", "copa", "--budget", "1.5", "--json", str(tmp_path / "x")]) == 2
    assert "--budget must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.integration  # lm-eval's CLI indexes all of its ~10k built-in task configs first (~20 s)
def test_lm_eval_cli_wrapper(tiny_dir, task_dir, tmp_path, monkeypatch):
    """``python -m h2okv.eval.lm_eval_model`` is lm-eval's CLI with ``--model h2okv`` available."""
    import sys

    from h2okv.eval import lm_eval_model

    monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "h2okv", "--model_args",
                                      f"pretrained={tiny_dir},policy=h2o,heavy_ratio=0.1,recent_ratio=0.1",
                                      "--tasks", TASK, "--include_path", str(task_dir), "--limit", "2",
                                      "--output_path", str(tmp_path / "out")])
    assert lm_eval_model.main() == 0
    results = list((tmp_path / "out").rglob("results*.json"))
    assert results and TASK in json.loads(results[0].read_text())["results"]


@pytest.mark.integration
def test_default_model_scores_with_eviction(default_model):
    """The embedded SmolLM2 through the adapter: one Shakespeare item, 4 choices."""
    model, tok = default_model
    item = tasks_mod.shakespeare_next_line_items(n_items=1)[0]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(item["context"], choice), idx=i)
            for i, choice in enumerate(item["choices"])]

    def scores(**kw):
        return [lp for lp, _ in H2OLM(pretrained=model, tokenizer=tok, batch_size=4, **kw).loglikelihood(reqs, disable_tqdm=True)]

    full, h2o, roomy = scores(policy="full"), scores(policy="h2o"), scores(policy="h2o", heavy=4096, recent=4096)
    assert roomy == pytest.approx(full, abs=1e-3)
    assert max(abs(a - b) for a, b in zip(full, h2o, strict=True)) > 0.05


def test_every_tiny_architecture(arch_model):
    """Positions under left padding, logits_to_keep and the cache work for each architecture."""
    arch, model = arch_model
    tok = word_tokenizer()
    reqs = requests_for(random.Random(5), 5)
    full = H2OLM(pretrained=model, tokenizer=tok, policy="full", batch_size=5)._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (lp, _), (_, ctx, cont) in zip(full, reqs, strict=True):
        assert lp == pytest.approx(reference_loglik(model, ctx, cont), abs=1e-4), arch
    batched = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", heavy=3, recent=3, batch_size=5)
    single = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", heavy=3, recent=3, batch_size=1)
    a = batched._loglikelihood_tokens(reqs, disable_tqdm=True)
    b = single._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-4), arch


def test_stop_strings_with_and_without_leading_whitespace():
    from h2okv.eval.lm_eval_model import StopOnStrings

    texts = {(1,): "\n", (2,): "\nsummary", (3,): "\nsummary\nmore"}

    class Decoder:
        def decode(self, ids, skip_special_tokens=True):
            return texts[tuple(ids.tolist())]

    ids = torch.tensor([[9, 1], [9, 2], [9, 3]])  # one prompt token, then the generated one
    exact = StopOnStrings(Decoder(), ["\n"], prompt_len=1)
    lenient = StopOnStrings(Decoder(), ["\n"], prompt_len=1, lstrip=True)
    assert exact(ids, None).tolist() == [True, True, True]  # lm-eval's `until`: anywhere
    assert lenient(ids, None).tolist() == [False, False, True]  # summaries: after the first text
    assert cut_at_stops("\nsummary\nmore".lstrip(), ["\n"]) == "summary"
