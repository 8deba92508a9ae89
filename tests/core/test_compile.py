"""torch.compile(model, fullgraph=True, dynamic=False) over decode steps at the budget: one graph,
no recompilation from step to step, the eager cache's tokens and logits. The backend here counts
the graphs dynamo hands it and runs them as they are (inductor compiles for minutes)."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import use_kernels
from h2okv.tools.tiny import random_ids, tiny_model

torch._dynamo = pytest.importorskip("torch._dynamo")

WARMUP, STEPS = 3, 100


def decode(model, forward, steps, prompt, **coding):
    """Prefill eagerly (the prompt takes the cache to its budget), then ``steps`` greedy steps through
    ``forward``; ``coding``: quantized slots' keywords."""
    cache = H2OCache(model, budget=32, compileable=True, **coding)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, **cache_arg(cache))
        tokens, logits = [], []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = forward(input_ids=token, use_cache=True, **cache_arg(cache))
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            logits.append(out.logits[:, -1])
    return cache, torch.cat(tokens, 1), torch.stack(logits)


@pytest.mark.parametrize("coding", [{}, {"kv_bits": 4, "key_bits": 8, "kv_group": 8},
                                    {"kv_bits": 4, "key_bits": 8, "kv_group": 8, "float_window": 8},
                                    {"kv_bits": 4, "kv_group": 8, "center_keys": True}],
                         ids=["float", "quantized", "float-window", "centered-keys"])
def test_compiled_decode_at_budget_one_graph_no_recompile(coding):
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):  # a backend that counts the graphs it is given, runs them as they are
        graphs.append(gm)
        return gm.forward

    model = tiny_model("llama")
    prompt = random_ids(64, batch=2)
    with use_kernels("eager"):  # the reference: the same tensor-op steps, not compiled
        _, want_tokens, want_logits = decode(model, model, WARMUP + STEPS, prompt, **coding)
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counting)
        warm = []

        def forward(**kwargs):
            out = compiled(**kwargs)
            warm.append(len(graphs))
            return out

        cache, tokens, logits = decode(model, forward, WARMUP + STEPS, prompt, **coding)
    torch._dynamo.reset()
    assert cache.is_compileable
    assert warm[WARMUP - 1] >= 1
    assert warm[-1] == warm[WARMUP - 1], f"recompiled after warm-up: {warm}"
    assert len(graphs) == 1  # fullgraph: a break would have raised; one graph for every step
    assert all(layer.capacity == 33 for layer in cache.layers)  # at the budget throughout
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 64 + WARMUP + STEPS


def test_generate_compiles_decode_steps_at_budget():
    """generate compiles the decode steps of a compileable cache when asked (CompileConfig; on CPU
    only with ``_compile_all_devices``): it hands them a [B, 1, 1, 1] mask, which must not break
    the graph or leave the fast path."""
    from transformers import CompileConfig

    from h2okv.core.compat import cache_kwarg

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny_model("llama")
    prompt = random_ids(64, batch=2)

    def generate(**kwargs):
        cache = H2OCache(model, budget=32, compileable=True)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                             pad_token_id=1, **{cache_kwarg(): cache}, **kwargs)
        return out[:, 64:]

    config = CompileConfig(fullgraph=True, dynamic=False, backend=counting, mode=None)
    config._compile_all_devices = True
    with use_kernels("eager"):
        want = generate(disable_compile=True)
        got = generate(compile_config=config)
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert torch.equal(got, want)


def test_generate_with_compile_gives_the_eager_tokens():
    """``h2okv generate --compile``'s path: the same greedy tokens as without it, the steps at the
    budget compiled (a budget under the prompt: every decode step is at it)."""
    from h2okv.generation import generate
    from h2okv.tools.tiny import word_tokenizer

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, tok = tiny_model("llama"), word_tokenizer()
    prompt = " ".join(f"w{i % 50}" for i in range(60))
    runs = {name: generate(model, tok, prompt, budget=16, max_new_tokens=24, ignore_eos=True, compile=backend)
            for name, backend in (("eager", None), ("compiled", counting))}
    torch._dynamo.reset()
    assert runs["compiled"].token_ids == runs["eager"].token_ids
    assert len(graphs) >= 1 and runs["compiled"].stats["budget"] == [16]
