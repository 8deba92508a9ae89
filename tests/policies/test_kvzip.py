"""Policy ``kvzip`` and ``h2okv.reconstruct``: the prompt is ranked by the attention the model pays
it while repeating it. Held to a plain reference (a full forward of prompt + probe with eager
attention, max over the probe's queries and each KV head's query group), with the shared
guarantees: the budget, exactness when nothing is evicted, batch == batch-of-one, GQA K/V never
expanded, and one-line errors wherever the pass cannot run."""

import pytest
import torch

from char_tokenizers import Tok
from h2okv import H2OCache, reconstruct
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import FIRST, NEXT, QUOTED, probes
from h2okv.errors import H2OError
from h2okv.policies.kvzip import SINKS
from h2okv.tools.tiny import tiny_model


def gqa_model(seed=1, eager=False):
    model = tiny_model("llama", seed=seed, num_attention_heads=4, num_key_value_heads=2)
    if eager:
        model.set_attn_implementation("eager")
    return model


def read_and_rank(model, ids, heavy, recent, start=0, chunk_size=2048, policy="kvzip", **options):
    cache = H2OCache(model, policy=policy, heavy=heavy, recent=recent, prefill="late", **options)
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(cache))
    reconstruct(model, cache, ids, Tok(), start=start, chunk_size=chunk_size)
    return cache


def kept(layer, row=0):
    layer.to_dense()  # a layer the C step holds flat is read in its dense layout
    return [sorted(layer.ordinal[row, h][layer.valid[row, h]].tolist()) for h in range(layer.valid.shape[1])]


def reference_scores(ids, start=0, chunk_size=2048, question=0, local=False):
    """``[layers, KV heads, n]``: each probe read after the prompt by a plain full-cache forward
    (eager attention, every probability returned); a token's score is its largest probability from
    any probe query of its KV head's group, over all probes, and with ``question=W`` from any of
    the prompt's own last ``W`` queries too. ``local``: each probe's probabilities renormalized
    over the prompt positions it repeats, the first ``max(start, SINKS)`` and the probe itself (a
    softmax over a subset is the whole softmax divided by the subset's mass)."""
    model, n = gqa_model(eager=True), ids.shape[1]
    best = None
    for probe, first in zip(probes(Tok(), ids, start, chunk_size), range(start, n, chunk_size), strict=True):
        with torch.inference_mode():
            attentions = model(input_ids=torch.cat([ids, probe], 1), output_attentions=True).attentions
        if local:
            keep = torch.ones(n + probe.shape[1], dtype=torch.bool)
            keep[max(start, SINKS):first] = keep[min(first + chunk_size, n):n] = False
            attentions = [a * keep / (a * keep).sum(-1, keepdim=True) for a in attentions]
        readers = slice(n - question, None) if question else slice(n, None)
        scores = torch.stack([a[0, :, readers, :n].amax(dim=1).view(2, 2, n).amax(1) for a in attentions])
        best = scores if best is None else torch.maximum(best, scores)
    return best


def reference_kept(ids, heavy, recent, start=0, chunk_size=2048, question=0, local=False):
    """Sinks and the recent window are kept, then each head's top scores."""
    n, best = ids.shape[1], reference_scores(ids, start, chunk_size, question, local)
    out = []
    for layer_scores in best:
        heads = []
        for s in layer_scores:
            s = s.clone()
            s[:SINKS] = s[n - recent:] = float("inf")
            heads.append(sorted(s.topk(heavy + recent).indices.tolist()))
        out.append(heads)
    return out


@pytest.mark.parametrize("start, chunk_size", [(0, 2048), (3, 2048), (3, 20)])
def test_kept_tokens_equal_the_reference(start, chunk_size):
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    cache = read_and_rank(gqa_model(), ids, heavy=10, recent=4, start=start, chunk_size=chunk_size)
    assert [kept(layer) for layer in cache.layers] == reference_kept(ids, 10, 4, start, chunk_size)
    assert cache.get_seq_length() == 60  # the probe is read, never kept: positions go on from the prompt
    assert all(layer.keys.shape[1] == 2 for layer in cache.layers)  # KV heads, not query heads


@pytest.mark.parametrize("start, chunk_size", [(0, 20), (3, 20), (3, 2048)])
def test_local_scores_each_chunk_on_what_it_repeats(start, chunk_size):
    """``kvzip:local=1``: each probe call's scores are its probabilities renormalized over the
    chunk it repeats, the head and sinks, and itself; the kept sets equal that reference, differ
    from the whole-cache scores' where there are several chunks, and equal them with one."""
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    cache = read_and_rank(gqa_model(), ids, heavy=10, recent=4, start=start, chunk_size=chunk_size,
                          policy="kvzip:local=1")
    want = reference_kept(ids, 10, 4, start, chunk_size, local=True)
    assert [kept(layer) for layer in cache.layers] == want
    assert (want == reference_kept(ids, 10, 4, start, chunk_size)) == (chunk_size >= 60)
    for layer, scores in zip(cache.layers, reference_scores(ids, start, chunk_size, local=True), strict=True):
        layer.to_dense()
        for h in range(2):
            live = layer.valid[0, h]
            torch.testing.assert_close(layer.score[0, h][live], scores[h][layer.ordinal[0, h][live]],
                                       rtol=1e-4, atol=1e-6)


def test_local_scores_need_each_calls_span():
    from h2okv.core.reconstruction import rank_by_probes

    model, ids = gqa_model(), torch.randint(2, 90, (1, 40))
    cache = H2OCache(model, policy="kvzip:local=1", heavy=10, recent=4, prefill="late")
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(cache))
        with pytest.raises(H2OError, match="give rank_by_probes each call's span") as err:
            rank_by_probes(model, cache, probes(Tok(), ids, 0, 20))
    assert "\n" not in str(err.value)


def test_a_probe_block_held_to_its_bytes_gives_the_same_scores(monkeypatch):
    """The probe's query blocks are capped in bytes (a long prompt's blocks took the peak memory
    past full's): one query a block ranks as the chunk-sized blocks do, the scores equal up to a
    matmul's rounding (its sums are ordered by its shape)."""
    import h2okv.core.reconstruction as reconstruction

    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    softmaxes = []
    real = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: softmaxes.append(1) or real(*a, **k))

    def ranked():
        softmaxes.clear()
        cache = read_and_rank(gqa_model(), ids, heavy=10, recent=4, start=3, chunk_size=20)
        return cache, len(softmaxes)

    wide, wide_blocks = ranked()
    monkeypatch.setattr(reconstruction, "CPU_PROBE_BLOCK_BYTES", 1)
    narrow, narrow_blocks = ranked()
    assert narrow_blocks > 5 * wide_blocks  # the cap took the blocks down to one query each
    assert [kept(layer) for layer in narrow.layers] == reference_kept(ids, 10, 4, 3, 20)
    for a, b in zip(narrow.layers, wide.layers, strict=True):
        assert torch.equal(a.valid, b.valid)
        torch.testing.assert_close(a.score[a.valid], b.score[b.valid], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("question", [1, 6])
def test_question_attention_joins_the_probe(question):
    """``kvzip:question=W``: a token's score is the larger of the probe's and the prompt's last
    ``W`` queries' attention, and the kept sets follow that rule written out; the question's
    attention changes what is kept (else the option would do nothing)."""
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    cache = read_and_rank(gqa_model(), ids, heavy=10, recent=4, policy=f"kvzip:question={question}")
    want = reference_kept(ids, 10, 4, question=question)
    assert [kept(layer) for layer in cache.layers] == want
    assert want != reference_kept(ids, 10, 4)


def test_probes_quote_the_previous_chunk():
    ids = torch.arange(10, 60).unsqueeze(0)
    calls = probes(Tok(), ids, start=5, chunk_size=20)
    first, nxt, tail = Tok()(FIRST)["input_ids"], Tok()(NEXT)["input_ids"], Tok()("\n")["input_ids"]
    assert [c.shape[1] for c in calls] == [len(first) + 1 + 20, len(nxt) + QUOTED + 1 + 20, len(nxt) + QUOTED + 1 + 5]
    assert calls[0][0].tolist() == first + tail + list(range(15, 35))
    assert calls[1][0].tolist() == nxt + list(range(35 - QUOTED, 35)) + tail + list(range(35, 55))


def test_budget_kept_while_decoding_and_exact_when_nothing_is_evicted():
    torch.manual_seed(1)
    model = gqa_model()
    ids, question = torch.randint(2, 90, (1, 50)), torch.randint(2, 90, (1, 6))
    full_ids = torch.cat([ids, question], 1)
    with torch.inference_mode():
        plain = model.generate(input_ids=full_ids, max_new_tokens=8, do_sample=False)
        roomy = read_and_rank(model, ids, heavy=100, recent=10)
        assert model.generate(input_ids=full_ids, **cache_arg(roomy), max_new_tokens=8,
                              do_sample=False).tolist() == plain.tolist()
        tight = read_and_rank(model, ids, heavy=8, recent=4, policy="kvzip:tail=0")
        assert tight.stats()["slots"] == [12, 12] and tight.stats()["peak_capacity"] == [50, 50]
        for _ in range(5):  # the question, then decode steps: h2o's rule on top of the probe's scores
            model(input_ids=question[:, :1], **cache_arg(tight))
            assert tight.stats()["slots"] == [12, 12]


@pytest.mark.parametrize("one_call", [True, False])
def test_tail_keeps_what_is_read_after_the_ranking_whole(one_call):
    """tail=N: the ranked context stays as ranked while the first N tokens read after it (the
    question, the answer) are all kept; past N, the budget (ranked + N) holds."""
    torch.manual_seed(1)
    model = gqa_model()
    ids, question = torch.randint(2, 90, (1, 50)), torch.randint(2, 90, (1, 6))
    with torch.inference_mode():
        cache = read_and_rank(model, ids, heavy=8, recent=4, policy="kvzip:tail=6")
        ranked = [kept(layer) for layer in cache.layers]
        for ids_part in ([question] if one_call else question.split(1, dim=1)):
            model(input_ids=ids_part, **cache_arg(cache))
        assert cache.stats()["slots"] == [18, 18]
        assert [kept(layer) for layer in cache.layers] == [[h + list(range(50, 56)) for h in layer] for layer in ranked]
        model(input_ids=question[:, :1], **cache_arg(cache))
        assert cache.stats()["slots"] == [18, 18]
    assert H2OCache(model, policy="kvzip", budget=0.2, prefill="late").policy.tail == 256


@pytest.mark.parametrize("policy", ["kvzip", "kvzip:question=4"])
def test_batch_equals_batch_of_one(policy):
    torch.manual_seed(2)
    model = gqa_model()
    ids = torch.randint(2, 90, (2, 40))
    both = read_and_rank(model, ids, heavy=8, recent=3, start=2, policy=policy)
    for row in range(2):
        alone = read_and_rank(model, ids[row:row + 1], heavy=8, recent=3, start=2, policy=policy)
        assert [kept(layer, row) for layer in both.layers] == [kept(layer) for layer in alone.layers]


def test_head_adaptive_budgets_keep_each_layers_total():
    torch.manual_seed(3)
    cache = read_and_rank(gqa_model(), torch.randint(2, 90, (1, 60)), heavy=10, recent=4, head_budgets="adaptive")
    for layer in cache.layers:
        per_head = layer.live_slots()[0]
        assert int(per_head.sum()) == 2 * 14 and int(per_head.min()) >= 4 + SINKS


def test_layers_share_the_whole_caches_slots_by_rank():
    """head_budgets=layers (floor 0): the cache keeps, over every layer and head at once, the
    sinks, the recent windows and the best ``layers x heads x (heavy - sinks)`` other tokens."""
    torch.manual_seed(4)
    ids, heavy, recent = torch.randint(2, 90, (1, 60)), 10, 4
    cache = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, head_budgets="layers", head_floor=0.0,
                          policy="kvzip:tail=0")  # no slots for what follows: capacity == budget + 1
    n, scores = 60, reference_scores(ids)
    free = scores.clone()
    free[..., :SINKS] = free[..., n - recent:] = -1.0  # not candidates
    chosen = free.flatten().topk(2 * 2 * (heavy - SINKS)).indices
    expected = torch.zeros_like(free, dtype=torch.bool).flatten()
    expected[chosen] = True
    expected = expected.view_as(free)
    expected[..., :SINKS] = expected[..., n - recent:] = True
    assert [kept(layer) for layer in cache.layers] == [
        [torch.nonzero(head).flatten().tolist() for head in layer] for layer in expected]
    per_layer = [int(layer.live_slots()[0].sum()) for layer in cache.layers]
    assert sum(per_layer) == 2 * 2 * (heavy + recent) and len(set(per_layer)) > 1  # the layers differ
    stats = cache.stats()
    assert stats["head_budgets"] == "layers" and stats["capacity"] == [r[1] + 1 for r in stats["head_budget_range"]]
    with pytest.raises(H2OError, match="every layer ranked at once"):
        H2OCache(gqa_model(), policy="snapkv", heavy=8, recent=4, prefill="late", head_budgets="layers")


def test_a_ceiling_caps_each_head_of_the_whole_caches_split():
    """``kvzip:ceiling=C`` with head_budgets=layers: no head keeps more than its own best
    ``ceil(C x (heavy - sinks))`` besides its sinks and recent window, the cache's total is kept,
    and at C=1 every head keeps its own best ``heavy - sinks``: the uniform split, token for token."""
    torch.manual_seed(4)
    ids, heavy, recent = torch.randint(2, 90, (1, 60)), 10, 4
    free = heavy - SINKS
    shared = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, head_budgets="layers", head_floor=0.0,
                           policy="kvzip:tail=0")
    widest = max(int(layer.live_slots()[0].max()) for layer in shared.layers)
    assert widest > SINKS + recent + 1.5 * free  # uncapped, some head takes more than the cap below
    capped = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, head_budgets="layers", head_floor=0.0,
                           policy="kvzip:tail=0,ceiling=1.5")
    live = torch.stack([layer.live_slots()[0] for layer in capped.layers])
    assert int(live.max()) <= SINKS + recent + 9 and int(live.sum()) == 2 * 2 * (heavy + recent)
    assert [kept(layer) for layer in capped.layers] != [kept(layer) for layer in shared.layers]
    one = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, head_budgets="layers", head_floor=0.0,
                        policy="kvzip:tail=0,ceiling=1")
    uniform = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, policy="kvzip:tail=0")
    assert [kept(layer) for layer in one.layers] == [kept(layer) for layer in uniform.layers]


def test_errors_are_one_line():
    model, ids = gqa_model(), torch.randint(2, 90, (1, 30))
    with pytest.raises(H2OError, match="prefill=late"):
        H2OCache(model, policy="kvzip", heavy=8, recent=4)
    with pytest.raises(H2OError, match="positions=true"):
        H2OCache(model, policy="kvzip", heavy=8, recent=4, prefill="late", positions="rolling")
    cache = H2OCache(model, policy="kvzip", heavy=8, recent=4, prefill="late")
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(cache))
        with pytest.raises(H2OError, match="h2okv.reconstruct"):  # decoding before the ranking
            model(input_ids=ids[:, :1], **cache_arg(cache))
    assert cache.get_seq_length() == 30  # refused before anything changed
    with pytest.raises(H2OError, match="ids the cache has read"):
        reconstruct(model, cache, ids[:, :20], Tok())
    reconstruct(model, cache, ids, Tok())
    with pytest.raises(H2OError, match="not been ranked yet"):
        reconstruct(model, cache, ids, Tok())
    h2o = H2OCache(model, policy="h2o", heavy=8, recent=4, prefill="late")
    with pytest.raises(H2OError, match="kvzip"):
        reconstruct(model, h2o, ids, Tok())


@pytest.mark.parametrize("argv", [
    ["eval", "reasoning", "--policies", "h2o,kvzip"],
    ["eval", "ppl", "--policies", "kvzip"],
])
def test_commands_without_the_pass_refuse_kvzip(argv, capsys, monkeypatch):
    import h2okv.models
    from h2okv.cli import main

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: pytest.fail("refused before loading"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "reconstruct" in err and err.count("\n") == 1


def test_bench_ranks_kvzip_by_reconstruction_before_its_decode_steps(default_model):
    """bench --policies takes kvzip: its cache reads the prompt whole and is ranked by the probe
    before the timed steps (a cache that was not would refuse to decode), keeping h2o's budget;
    with the cache-wide split its layers allocate at least the uniform bytes. Its scoring pass is
    the late read plus the probe."""
    from h2okv.bench.policy_speed import decode_costs, markdown, scoring_costs

    model, tokenizer = default_model
    torch.manual_seed(0)
    uniform = decode_costs(model, tokenizer, ["kvzip", "h2o"], context=96, budget=0.25, steps=2)
    assert uniform["kvzip"]["kept_tokens"] == uniform["h2o"]["kept_tokens"] == 24
    assert uniform["kvzip"]["kv_bytes_after_prompt"] == uniform["h2o"]["kv_bytes_after_prompt"]
    layers = decode_costs(model, tokenizer, ["kvzip"], context=96, budget=0.25, steps=2,
                          shape={"head_budgets": "layers", "head_floor": 0.0})
    assert layers["kvzip"]["kept_tokens"] >= 24
    assert layers["kvzip"]["kv_bytes_after_prompt"] >= uniform["kvzip"]["kv_bytes_after_prompt"]
    ids = torch.arange(100, 148).unsqueeze(0)
    scoring = scoring_costs(model, ids, ["kvzip"], 0.25, tokenizer=tokenizer)
    assert scoring["kvzip"]["seconds"] > 0
    report = markdown({"context": 96, "budget": 0.25, "steps": 2, "scoring_tokens": 48, "decode": uniform,
                       "scoring": scoring})
    assert "kvzip (late read + reconstruct)" in report and "kvzip (read late, ranked by reconstruct)" in report


def test_bench_refuses_kvzip_on_a_model_without_a_tokenizer(capsys):
    from h2okv.cli import main

    assert main(["bench", "--model", "tiny:llama", "--policies", "kvzip", "--context", "64", "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and err.count("\n") == 1


def test_kernel_gives_each_token_its_best_neighbours_score_in_prompt_order():
    """``kvzip:kernel=3``: a token takes the largest score among the tokens next to it *in the
    prompt* (slots may hold them in any order), free slots stay 0, and kernel 1 is KVzip's own."""
    from h2okv.policies import make_policy

    ordinal = torch.tensor([[[3, 0, 4, 1, 2, 0]]])  # slot -> token position; the last slot is free
    valid = torch.tensor([[[True, True, True, True, True, False]]])
    scores = torch.tensor([[[0.0, 0.1, 0.0, 0.0, 0.9, 0.0]]])  # token 2 (slot 4) stands out
    smoothed = make_policy("kvzip:kernel=3").smooth_probe(scores, ordinal, valid)
    # tokens 1, 2, 3 (slots 3, 4, 0) take 0.9; token 0 (slot 1) keeps max(0.1, token 1's 0); token 4 stays 0
    assert torch.equal(smoothed, torch.tensor([[[0.9, 0.1, 0.0, 0.9, 0.9, 0.0]]]))
    assert make_policy("kvzip").smooth_probe(scores, ordinal, valid) is scores


def test_a_planted_number_survives_whole_with_a_kernel():
    """A value of several tokens, one of whose tokens the probe scores high: single-token ranking
    keeps that token alone, ``kernel=5`` keeps the value's five tokens together."""
    from h2okv.policies import make_policy

    n = 40
    ordinal = torch.arange(n).view(1, 1, n)
    valid = torch.ones(1, 1, n, dtype=torch.bool)
    scores = torch.rand(1, 1, n, generator=torch.Generator().manual_seed(0)) * 0.1
    scores[0, 0, 22] = 1.0  # the middle digit of a number held by tokens 20..24
    for spec, want in (("kvzip", {22}), ("kvzip:kernel=5", set(range(20, 25)))):
        smoothed = make_policy(spec).smooth_probe(scores.clone(), ordinal, valid)
        top = set(smoothed[0, 0].topk(len(want)).indices.tolist())
        assert top == want, spec


def question_only_scores(ids, question):
    """``[layers, KV heads, n]``: each token's largest probability from the prompt's own last
    ``question`` queries (any query head of its KV head's group), no probe read."""
    model, n = gqa_model(eager=True), ids.shape[1]
    with torch.inference_mode():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    return torch.stack([a[0, :, n - question:, :n].amax(dim=1).view(2, 2, n).amax(1) for a in attentions])


def test_a_prompt_past_probe_upto_is_ranked_by_its_question_alone(monkeypatch):
    """``kvzip:question=W,probe_upto=N``: a prompt of at most N tokens is ranked as without the
    option (the probe read); a longer one reads no probe and keeps the reference's top tokens of
    the question's attention alone, which differ from the probe's (else the test proves nothing)."""
    import h2okv.core.reconstruction as reconstruction

    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    probe_calls = []
    real = reconstruction.cache_arg
    monkeypatch.setattr(reconstruction, "cache_arg", lambda cache: probe_calls.append(1) or real(cache))
    short = read_and_rank(gqa_model(), ids, heavy=10, recent=4, policy="kvzip:question=2,probe_upto=60")
    assert probe_calls and [kept(layer) for layer in short.layers] == reference_kept(ids, 10, 4, question=2)
    probe_calls.clear()
    long = read_and_rank(gqa_model(), ids, heavy=10, recent=4, policy="kvzip:question=2,probe_upto=59")
    assert not probe_calls
    want = []
    for layer_scores in question_only_scores(ids, 2):
        heads = []
        for s in layer_scores.clone():
            s[:SINKS] = s[60 - 4:] = float("inf")
            heads.append(sorted(s.topk(14).indices.tolist()))
        want.append(heads)
    assert [kept(layer) for layer in long.layers] == want
    assert want != reference_kept(ids, 10, 4, question=2)
    assert long.get_seq_length() == 60


def test_question_kernel_pools_the_question_scores_of_a_long_prompt():
    """Past ``probe_upto`` each token ranks by the best question score of the ``question_kernel``
    tokens around it: the kept slots' scores are those pooled maxima, and no evicted candidate
    (outside the sinks and the recent window) scores above a kept one."""
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 60))
    cache = read_and_rank(gqa_model(), ids, heavy=10, recent=4, policy="kvzip:question=6,probe_upto=8,question_kernel=5")
    raw = question_only_scores(ids, 6)
    pooled = torch.nn.functional.max_pool1d(raw.flatten(0, 1)[:, None], 5, stride=1, padding=2)[:, 0].view_as(raw)
    for layer, scores in zip(cache.layers, pooled, strict=True):
        layer.to_dense()
        for h in range(2):
            live = layer.valid[0, h]
            ordinals = layer.ordinal[0, h][live]
            torch.testing.assert_close(layer.score[0, h][live], scores[h][ordinals], rtol=1e-4, atol=1e-6)
            candidates = [t for t in range(SINKS, 60 - 4)]
            kept_here = [t for t in ordinals.tolist() if t in candidates]
            dropped = [t for t in candidates if t not in kept_here]
            assert min(scores[h][kept_here]) >= max(scores[h][dropped]) - 1e-6


def test_probe_upto_needs_the_question():
    with pytest.raises(H2OError, match="probe_upto .* give question=W"):
        H2OCache(gqa_model(), policy="kvzip:probe_upto=100", heavy=10, recent=4, prefill="late")


def test_question_share_keeps_the_questions_own_picks_first():
    """``kvzip:question=W,question_share=F``: where the pass ranks, each head keeps its best
    ``F * heavy`` tokens by the question's attention alone first, then the pass's (and question's)
    best: the reference's picks raised above every probability. The kept sets differ from the
    option's absence (else the test proves nothing)."""
    torch.manual_seed(0)
    ids, heavy, recent = torch.randint(2, 90, (1, 120)), 20, 4
    cache = read_and_rank(gqa_model(), ids, heavy=heavy, recent=recent, policy="kvzip:question=1,question_share=0.5")
    question, best = question_only_scores(ids, 1), reference_scores(ids, question=1)
    want = []
    for layer_question, layer_best in zip(question, best, strict=True):
        heads = []
        for q, s in zip(layer_question, layer_best.clone(), strict=True):
            s[q.topk(heavy // 2).indices] += 1.0
            s[:SINKS] = s[120 - recent:] = float("inf")
            heads.append(sorted(s.topk(heavy + recent).indices.tolist()))
        want.append(heads)
    assert [kept(layer) for layer in cache.layers] == want
    assert want != reference_kept(ids, heavy, recent, question=1)


def test_question_share_needs_the_question_and_a_share_in_range():
    with pytest.raises(H2OError, match="question_share .* give question=W"):
        H2OCache(gqa_model(), policy="kvzip:question_share=0.5", heavy=10, recent=4, prefill="late")
    with pytest.raises(H2OError, match="question_share"):
        H2OCache(gqa_model(), policy="kvzip:question=2,question_share=1.5", heavy=10, recent=4, prefill="late")
