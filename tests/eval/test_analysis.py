import json
import math

import pytest
import torch

import h2okv.models
from h2okv import H2OCache
from h2okv.cli import main
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.eval.analysis import (
    accumulated_attention,
    fit_power_law,
    layer_stats,
    record_attention,
    row_sparsity_counts,
    top_share,
)
from h2okv.tools.tiny import VOCAB, random_ids, tiny_model


def hand_made_probs():
    # head 0: one entry below 1% of its row max in rows 1 and 2; head 1: uniform causal rows
    head0 = [[1.0, 0.0, 0.0], [0.995, 0.005, 0.0], [0.5, 0.4999, 0.0001]]
    head1 = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]
    return torch.tensor([[head0, head1]])  # [B=1, H=2, 3, 3]


def test_sparsity_counts_only_causal_entries():
    below, total = row_sparsity_counts(hand_made_probs(), threshold=0.01)
    # 6 causal entries per head; the zeros above the diagonal are masked, not sparse
    assert total.tolist() == [6, 6]
    assert below.tolist() == [2, 0]
    below, _ = row_sparsity_counts(hand_made_probs(), threshold=0.9999)
    # 0.9999 x max: row1 0.005; row2 0.4999 and 0.0001 (< 0.49995); head 1's equal entries: none
    assert below.tolist() == [3, 0]


def test_sparsity_rejects_non_square():
    with pytest.raises(H2OError, match="square attention"):
        row_sparsity_counts(torch.zeros(1, 2, 3, 4))


def test_accumulated_attention_is_column_sums():
    acc = accumulated_attention(hand_made_probs())
    assert acc[0].tolist() == pytest.approx([2.495, 0.5049, 0.0001])
    assert acc[1].tolist() == pytest.approx([1 + 0.5 + 1 / 3, 0.5 + 1 / 3, 1 / 3])


def test_power_law_fit_recovers_exponent():
    ranks = torch.arange(1, 201, dtype=torch.float64)
    values = 7.0 * ranks ** -1.5
    shuffled = values[torch.randperm(200, generator=torch.Generator().manual_seed(0))]
    fit = fit_power_law(shuffled, skip_first=0)
    assert fit.slope == pytest.approx(-1.5, abs=1e-9) and fit.r2 == pytest.approx(1.0)
    # a sink-like first value far above the line is left out by default
    spiked = values.clone()
    spiked[0] = 1e6
    assert fit_power_law(spiked).slope == pytest.approx(-1.5, abs=1e-9)


def test_top_share():
    assert top_share(torch.tensor([1.0, 4.0, 2.0, 3.0]), 0.25) == pytest.approx(0.4)
    assert top_share(torch.tensor([1.0, 4.0, 2.0, 3.0]), 0.5) == pytest.approx(0.7)


def test_record_attention_on_a_tiny_model_restores_attention():
    model = tiny_model("llama", seed=4, layers=3)
    H2OCache(model)  # switches the model to the registered h2o attention
    before = model.config._attn_implementation
    ids = random_ids(40, batch=2)
    recorder = record_attention(model, ids)
    assert model.config._attn_implementation == before
    assert sorted(recorder.accumulated) == [0, 1, 2]
    for acc in recorder.accumulated.values():
        # every query row is a distribution: the column sums of a head add up to B x N
        assert acc.sum(-1).tolist() == pytest.approx([2 * 40.0] * 4, rel=1e-4)
    rows = layer_stats(recorder)
    assert [r.layer for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r.min_head_sparsity <= r.sparsity <= r.max_head_sparsity <= 1.0
        assert r.top10_share <= r.top20_share <= 1.0 and math.isfinite(r.powerlaw_slope)
    # the model still runs with an eviction cache afterwards
    out = model(ids, **cache_arg(H2OCache(model, policy="h2o", heavy=5, recent=5)), use_cache=True)
    assert torch.isfinite(out.logits).all()


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % (VOCAB - 4) for c in text]}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--threshold", "1.5"], "--threshold must be in (0, 1)"),
        (["--plot", "s.svg"], "--plot must end in .png"),
        (["--powerlaw-plot", "p.pdf"], "--plot must end in .png"),
        (["--text", "/no/such/file"], "text file not found"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["analyze", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and message in err and "\n" not in err


def test_cli_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama", seed=6, layers=2)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    text = tmp_path / "t.txt"
    text.write_text("Something is rotten in the state of Denmark. " * 4)
    out_json, sparsity_png, power_png = tmp_path / "a.json", tmp_path / "s.png", tmp_path / "p.png"
    argv = ["analyze", "--text", str(text), "--tokens", "150", "--json", str(out_json), "--plot", str(sparsity_png),
            "--powerlaw-plot", str(power_png)]
    assert main(argv) == 0
    rows = json.loads(out_json.read_text())
    assert [r["layer"] for r in rows] == [0, 1]
    assert sparsity_png.read_bytes()[:4] == b"\x89PNG" and power_png.read_bytes()[:4] == b"\x89PNG"
    assert "mean sparsity" in capsys.readouterr().out
    assert main([*argv[:3], "--tokens", "5000"]) == 2  # longer than the text
