"""``h2okv serve`` on the real default model (SmolLM2-135M-Instruct), through the openai client."""

import openai
import pytest

from h2okv.serve import create_app, running_server
from h2okv.serve.engine import EngineOptions


@pytest.mark.integration
def test_chat_on_the_default_model(default_model):
    model, tok = default_model
    app = create_app(model, tok, model_name="smollm2", options=EngineOptions(max_batch=4))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        runs = {}
        for name, h2o in (("full", {"policy": "full"}), ("roomy", {"heavy": 1000, "recent": 1000}),
                          ("h2o", {"budget": 16})):
            runs[name] = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                                        temperature=0, extra_body={"h2o": h2o})
        streamed = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"h2o": {"policy": "full"}})
        streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    full = runs["full"].choices[0].message.content
    assert full.strip() and runs["full"].usage.completion_tokens > 0
    # a budget that covers the whole sequence evicts nothing: same text as the full cache
    assert runs["roomy"].choices[0].message.content == full
    assert streamed_text == full
    h2o = runs["h2o"].model_extra["h2o"]
    assert h2o["policy"] == "h2o" and h2o["kv_slots"] < runs["full"].model_extra["h2o"]["kv_slots"]
