"""What a request without ``temperature`` / ``top_p`` samples with: the server's flags, else the
model's generation config, else the built-in models' own, else OpenAI's 1 and 1."""

import httpx
import pytest
from transformers import GenerationConfig

from h2okv import cli
from h2okv.serve import create_app, running_server
from h2okv.serve.api.sampling_defaults import BUILT_IN, SamplingDefaults
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"


def test_flags_then_generation_config_then_built_in_then_openai():
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95)
    assert SamplingDefaults.resolve("smollm2", config, 0.3, 0.5) == SamplingDefaults(0.3, 0.5, "the server's flags")
    assert SamplingDefaults.resolve("smollm2", config) == SamplingDefaults(0.6, 0.95, "the model's generation config")
    assert SamplingDefaults.resolve("smollm2", GenerationConfig()).temperature == 0.0  # built in: greedy
    qwen = SamplingDefaults.resolve("qwen2.5-1.5b", GenerationConfig())
    assert (qwen.temperature, qwen.top_p) == BUILT_IN["qwen2.5-1.5b"][:2] == (0.7, 0.8)
    assert SamplingDefaults.resolve("my/model", GenerationConfig()) == SamplingDefaults(1.0, 1.0, "OpenAI's defaults")
    mixed = SamplingDefaults.resolve("my/model", GenerationConfig(top_p=0.9), temperature=0.0)
    assert (mixed.temperature, mixed.top_p) == (0.0, 0.9)
    assert mixed.source == "temperature: --temperature flag; top_p: the model's generation config"


def test_values_no_request_could_give_fall_through():
    odd = GenerationConfig(do_sample=True, temperature=5.0, top_p=0.0)
    assert SamplingDefaults.resolve("my/model", odd) == SamplingDefaults(1.0, 1.0, "OpenAI's defaults")


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, max_positions=256, initializer_range=0.3)


def complete(url, **fields):
    body = {"model": NAME, "prompt": "sampling defaults", "max_tokens": 12, "ignore_eos": True, **fields}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_request_without_temperature_takes_the_servers(model_tok):
    """Greedy server defaults: every omitted temperature gives temperature 0's text, whatever the
    seed; a request's own temperature still samples (seeded texts that differ from greedy)."""
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=32),
                     sampling=SamplingDefaults(0.0, 1.0, "test"))
    with running_server(app) as url:
        greedy = complete(url, temperature=0)
        assert [complete(url, seed=seed) for seed in range(3)] == [greedy] * 3
        sampled = {complete(url, temperature=2.0, seed=seed) for seed in range(3)}
        assert sampled != {greedy}
        settings = httpx.get(url + "/v1/models").json()["data"][0]["h2o"]
        assert (settings["temperature"], settings["top_p"], settings["sampling_defaults_from"]) == (0.0, 1.0, "test")


def test_the_app_reads_the_models_generation_config(model_tok):
    model, tok = model_tok
    saved = model.generation_config
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.4, top_p=0.7)
    try:
        app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=32))
        with running_server(app) as url:
            settings = httpx.get(url + "/v1/models").json()["data"][0]["h2o"]
    finally:
        model.generation_config = saved
    assert (settings["temperature"], settings["top_p"]) == (0.4, 0.7)


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--temperature", "3"], "--temperature must be at most 2"),
    (["serve", "--temperature", "-1"], "must be a finite number >= 0"),
    (["serve", "--top-p", "0"], "must be a positive number"),
])
def test_bad_sampling_flags_are_one_line_errors(capsys, argv, fragment):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
