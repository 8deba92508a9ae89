"""Rolling positions (``H2OCache(positions="rolling")``, ``core/positions.py``, ``core/rope.py``)
on tiny models whose context window is 64 positions, run for hundreds of tokens."""

from __future__ import annotations

import sys

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.positions import parse_positions
from h2okv.core.rope import RopeRotation, rotary_module
from h2okv.errors import H2OError
from h2okv.tools.tiny import random_ids, tiny_model

WINDOW = 64
SCHEMES = ["rolling:shift", "rolling:order"]
SCALED = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.fixture(scope="module")
def small():
    return tiny_model("llama", max_position_embeddings=WINDOW)


def rope_model(kind: str):
    extra = {} if SCALED[kind] is None else {"rope_parameters": SCALED[kind]}
    return tiny_model("llama", max_position_embeddings=WINDOW, **extra)


class PositionLog:
    """Every position_ids the model's rotary embedding is asked for."""

    def __init__(self, model):
        self.seen: list[torch.Tensor] = []
        self.handle = rotary_module(model).register_forward_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs, out):
        self.seen.append((kwargs["position_ids"] if "position_ids" in kwargs else args[1]).clone())

    def max(self) -> int:
        return max(int(p.max()) for p in self.seen)

    def close(self):
        self.handle.remove()


def model_keys(model, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the model's layer computes as keys of ``hidden`` at ``positions``: ``[B, Hkv, n, D]``."""
    layer = model.model.layers[layer_idx]
    attn = layer.self_attn
    b, n, _ = hidden.shape
    k = attn.k_proj(layer.input_layernorm(hidden)).view(b, n, -1, attn.head_dim).transpose(1, 2)
    cos, sin = rotary_module(model)(hidden, positions)
    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    return apply(k, k, cos, sin)[1]


# -- the rotation algebra ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(SCALED))
def test_rerotation_equals_recomputing_the_keys_at_the_new_positions(kind):
    model = rope_model(kind)
    rope = RopeRotation.from_model(model)
    hidden = model.model.embed_tokens(random_ids(6, batch=2, seed=1))
    start = torch.tensor([[0, 5, 17, 40, 63, 200]] * 2)
    delta = torch.tensor([[[30, -5, 20, -40, -63, -150]]]).expand(2, 2, 6)
    keys = model_keys(model, 0, hidden, start)
    rope.rotate_(keys, delta)
    expected = model_keys(model, 0, hidden, start + delta[:, 0])
    assert torch.allclose(keys, expected, atol=2e-5), (keys - expected).abs().max()


def test_rerotation_is_in_place_and_exact_for_zero(small):
    rope = RopeRotation.from_model(small)
    keys = torch.randn(2, 2, 5, 16)
    before, data = keys.clone(), keys.data_ptr()
    rope.rotate_(keys, torch.zeros(2, 2, 5, dtype=torch.long))
    assert keys.data_ptr() == data and torch.equal(keys, before)


# -- positions stay inside the window ---------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("policy", ["h2o", "sink", "h2o-mean", "tova", "local"])
def test_generation_keeps_every_position_inside_the_window(small, scheme, policy):
    log = PositionLog(small)
    try:
        cache = H2OCache(small, policy, heavy=8, recent=8, positions=scheme)
        out = small.generate(random_ids(30), **cache_arg(cache), max_new_tokens=300, min_new_tokens=300,
                             do_sample=False)
    finally:
        log.close()
    assert out.shape[1] == 330
    assert log.max() < WINDOW
    assert cache.get_seq_length() == 329  # true count of tokens read, unchanged


def test_generate_past_the_window_reports_flat_kv_memory_as_it_goes(small, tiny_dir):
    """What `h2okv generate --positions rolling --kv-every K --stream` shows: KV bytes every K tokens,
    each reported as it happens, flat once the budget is full, for 4x the model's window."""
    from h2okv.generation import generate
    from h2okv.models import load_model

    _, tokenizer = load_model(str(tiny_dir), cache=False)  # a word tokenizer for the tiny vocab
    live = []
    result = generate(small, tokenizer, " ".join(f"w{i}" for i in range(5, 25)), heavy=8, recent=8,
                      max_new_tokens=4 * WINDOW, positions="rolling", kv_every=32, ignore_eos=True,
                      on_kv=lambda seen, kv, since, seconds: live.append((seen, kv, since, seconds)))
    assert result.new_tokens == 4 * WINDOW
    history = result.stats["kv_history"]
    assert [(seen, kv) for seen, kv, *_ in live] == history[:-1] and len(live) >= 8
    assert [since for _, _, since, _ in live] == [seen - live[0][0] for seen, *_ in live]
    assert [seconds for *_, seconds in live] == sorted(seconds for *_, seconds in live)
    after_fill = {kv for seen, kv in history if seen > 16}
    assert len(after_fill) == 1 and after_fill == {result.stats["kv_bytes"]}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("chunk", [1, 8])
def test_reading_in_pieces_keeps_positions_inside_the_window_at_constant_memory(small, scheme, chunk):
    log = PositionLog(small)
    cache = H2OCache(small, "h2o", heavy=8, recent=8, chunk_size=chunk, positions=scheme)
    ids = random_ids(480, seed=2)
    sizes = []
    try:
        for start in range(0, 480, 40):
            small(ids[:, start:start + 40], **cache_arg(cache), use_cache=True)
            sizes.append(cache.stats()["kv_bytes"])
    finally:
        log.close()
    assert log.max() < WINDOW
    assert len(set(sizes[1:])) == 1


def test_shift_keeps_true_distances_of_recent_keys_and_caps_old_ones(small):
    """After the shifts, each kept key of layer 0 is what the model computes at ``max(o - F, 0)``."""
    cache = H2OCache(small, "h2o", heavy=8, recent=8, positions="rolling:shift")
    ids = random_ids(200, batch=2, seed=4)
    for start in range(0, 200, 25):
        small(ids[:, start:start + 25], **cache_arg(cache), use_cache=True)
    layer, offset = cache.layers[0], cache.rolling.offset
    assert bool((offset > 0).all())
    hidden = small.model.embed_tokens(ids)
    for b in range(2):
        for h in range(layer.keys.shape[1]):
            kept = layer.valid[b, h].nonzero().flatten()
            ordinals = layer.ordinal[b, h, kept]
            rolled = (ordinals - offset[b]).clamp(min=0)
            assert int(rolled.max()) < WINDOW
            expected = model_keys(small, 0, hidden[b:b + 1, ordinals], rolled[None])[0, h]
            assert torch.allclose(layer.keys[b, h, kept], expected, atol=1e-5)


def test_order_puts_every_kept_key_at_its_rank(small):
    cache = H2OCache(small, "h2o", heavy=8, recent=8, positions="rolling:order")
    ids = random_ids(150, seed=5)
    small(ids[:, :40], **cache_arg(cache), use_cache=True)
    for t in range(40, 150):
        small(ids[:, t:t + 1], **cache_arg(cache), use_cache=True)
    cache.rolling.before_call(cache, torch.ones(1, 1, dtype=torch.bool))  # compacts, as a next call would
    layer = cache.layers[0]
    hidden = small.model.embed_tokens(ids)
    for h in range(layer.keys.shape[1]):
        kept = layer.valid[0, h].nonzero().flatten()
        ordinals, order = layer.ordinal[0, h, kept].sort()
        expected = model_keys(small, 0, hidden[:, ordinals], torch.arange(len(kept))[None])[0, h]
        assert torch.allclose(layer.keys[0, h, kept[order]], expected, atol=1e-5)


# -- exactness inside the window --------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("chunk", [1, 512])
def test_rolling_equals_true_positions_when_nothing_is_evicted_inside_the_window(small, scheme, chunk):
    ids = random_ids(60, batch=2, seed=6)
    true = small(ids, **cache_arg(H2OCache(small, "h2o", heavy=32, recent=32, chunk_size=chunk))).logits
    rolled = small(ids, **cache_arg(H2OCache(small, "h2o", heavy=32, recent=32, chunk_size=chunk,
                                                 positions=scheme))).logits
    assert torch.allclose(true, rolled, atol=1e-4)


def test_shift_equals_true_positions_with_eviction_until_the_first_shift(small):
    """The shift scheme changes nothing before a position would reach the window; cache order
    does (it closes the gaps eviction leaves), which is its point."""
    ids = random_ids(60, seed=7)
    true = small(ids, **cache_arg(H2OCache(small, "h2o", heavy=6, recent=6, chunk_size=1))).logits
    shift = small(ids, **cache_arg(H2OCache(small, "h2o", heavy=6, recent=6, chunk_size=1,
                                                positions="rolling:shift"))).logits
    assert torch.allclose(true, shift, atol=1e-4)


# -- batches ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_row_rolls_on_its_own_batch_equals_batch_of_one(small, scheme):
    prompts = [random_ids(20, seed=8)[0].tolist(), random_ids(33, seed=9)[0].tolist()]

    def run(rows):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        cache = H2OCache(small, "h2o", heavy=8, recent=8, positions=scheme)
        out = small.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=150,
                             min_new_tokens=150, do_sample=False, pad_token_id=0)
        return out[:, width:]

    both = run(prompts)
    for i, prompt in enumerate(prompts):
        assert torch.equal(both[i], run([prompt])[0])


def test_row_operations_carry_the_rolling_state(small):
    cache = H2OCache(small, "h2o", heavy=8, recent=8, positions="rolling:shift")
    ids = random_ids(100, batch=2, seed=10)
    for start in range(0, 100, 20):
        small(ids[:, start:start + 20], **cache_arg(cache), use_cache=True)
    offsets = cache.rolling.offset.clone()
    twin = cache.take_rows([1])
    assert twin.rolling.offset.tolist() == offsets[1:].tolist()
    cache.select_rows(torch.tensor([1, 0]))
    assert cache.rolling.offset.tolist() == offsets.flip(0).tolist()


# -- what cannot roll -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, match", [("opt", "no rotary"), ("gpt_neox", "partial rotary")])
def test_models_that_cannot_roll_are_refused_in_one_line(arch, match):
    with pytest.raises(H2OError, match=match) as err:
        H2OCache(tiny_model(arch), "h2o", heavy=4, recent=4, positions="rolling")
    assert "\n" not in str(err.value)


def test_length_dependent_rope_and_bad_names_are_refused():
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(H2OError, match="depend on the length"):
        H2OCache(dynamic, "h2o", heavy=4, recent=4, positions="rolling")
    with pytest.raises(H2OError, match="positions must be one of"):
        parse_positions("rolling:sideways")
    assert parse_positions("true") is None and parse_positions("rolling") in ("shift", "order")


def test_a_call_longer_than_the_window_is_refused_in_one_line(small):
    cache = H2OCache(small, "h2o", heavy=8, recent=8, positions="rolling")
    with pytest.raises(H2OError, match="feed the text in pieces"):
        small(random_ids(WINDOW + 1), **cache_arg(cache), use_cache=True)


# -- the long stream (eval ppl --window-tokens) -----------------------------------------------------
def test_stream_in_pieces_equals_one_call_and_rolls_past_the_window_at_constant_kv(small):
    from h2okv.eval.scoring import token_nll
    from h2okv.eval.stream import stream_ppl

    ids = random_ids(60, seed=11)[0]
    pieces = stream_ppl(small, ids, "h2o", 16, "true", window_tokens=20)
    one = small(ids[None], **cache_arg(H2OCache(small, "h2o", heavy=8, recent=8, chunk_size=1))).logits
    nll = token_nll(one, ids[None])[0]
    for w, end in zip(pieces.windows, (20, 40, 60), strict=True):
        start = max(0, end - 20 - 1)
        assert w.end == end
        assert w.ppl == pytest.approx(float(nll[start:end - 1].double().mean().exp()), rel=1e-4)

    long = stream_ppl(small, random_ids(400, seed=12)[0], "sink", 16, "rolling", window_tokens=32)
    assert len(long.windows) == 13 and len({w.kv_bytes for w in long.windows}) == 1
    assert all(w.tokens_per_s > 0 and w.cpu_tokens_per_s > 0 for w in long.windows)
    full = stream_ppl(small, random_ids(400, seed=12)[0], "full", None, "true", window_tokens=32)
    assert full.windows[-1].end == WINDOW and "context" in full.stopped
    with pytest.raises(H2OError, match="keeps every token"):
        stream_ppl(small, ids, "full", None, "rolling")


def test_reference_windows_equal_full_attention_over_each_window_and_its_context(small):
    """The yardstick run: each window's perplexity is that of one full-attention call over the
    window and the context before it, from a fresh cache, read in calls of the window's size."""
    from h2okv.eval.scoring import token_nll
    from h2okv.eval.stream import reference_ppl

    ids = random_ids(100, seed=13)[0]
    run = reference_ppl(small, ids, context_tokens=20, window_tokens=16)
    assert [w.end for w in run.windows] == [16, 32, 48, 64, 80, 96, 100] and run.positions == "sliding:20"
    for w in run.windows:
        start = w.end - 16 if w.end != 100 else 96
        lo = max(0, start - 20)
        nll = token_nll(small(ids[None, lo:w.end]).logits, ids[None, lo:w.end])[0][max(start - lo - 1, 0):]
        assert w.ppl == pytest.approx(float(nll.double().mean().exp()), rel=1e-4)
        assert w.kv_bytes > 0 and w.cpu_tokens_per_s > 0
    with pytest.raises(H2OError, match="exceed the model's context"):
        reference_ppl(small, ids, context_tokens=WINDOW, window_tokens=16)


def test_stream_plot_adds_the_ratio_panel_when_a_yardstick_is_there(small, tmp_path):
    from PIL import Image

    from h2okv.eval.stream import plot_stream, reference_ppl, stream_ppl

    ids = random_ids(96, seed=14)[0]
    rolled = stream_ppl(small, ids, "sink", 16, "rolling", window_tokens=32).as_dict()
    yardstick = reference_ppl(small, ids, context_tokens=16, window_tokens=32).as_dict()
    alone = Image.open(plot_stream([rolled], tmp_path / "one.png", "t", WINDOW)).size
    both = Image.open(plot_stream([yardstick, rolled], tmp_path / "two.png", "t", WINDOW)).size
    assert both[0] == alone[0] and both[1] > alone[1]  # a second panel below, same width
