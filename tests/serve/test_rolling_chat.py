"""A long conversation under eviction with rolling positions and the prefix store
(``tools/measure/rolling_chat.py`` measures it on the default model): every turn after the first
resumes the saved history, and the conversation's newest saved state stops growing once its
budget fills, though the conversation outgrows the model's context."""

import httpx
import pytest

from h2okv.serve import EvictionDefaults, create_app, running_server
from h2okv.serve.api.limits import ServerLimits
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny_chat import tiny_chat_model
from serve_cases import settle

NAME = "tiny"
CONTEXT = 128
BUDGET = 96  # slots: turn 1 fits, a later turn fills it
TURNS = 8


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, max_positions=CONTEXT, initializer_range=0.3)


def test_a_rolling_conversation_resumes_every_turn_and_its_state_stops_growing(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, eviction=EvictionDefaults.from_options(policy="h2o", budget=BUDGET),
                     options=EngineOptions(prefill_chunk=16, positions="rolling", prefix_memory=64 << 20),
                     limits=ServerLimits(max_prompt_tokens=4096))
    engine = app.state.engine
    messages = [{"role": "system", "content": "Read: to be or not"}]
    rows = []
    with running_server(app) as url, httpx.Client(timeout=60) as client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"question {turn}: why?"})
            r = client.post(url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 12,
                                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            settle(engine)  # the turn's iteration is over (its completed state is saved at the finish)
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            newest = max(engine.prefixes, key=lambda e: len(e.ids))  # the conversation's end
            rows.append((r.json()["usage"], len(newest.ids), newest.bytes))
    assert rows[-1][0]["prompt_tokens"] > CONTEXT  # the conversation outgrew the context: positions rolled
    assert rows[0][0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(usage["prompt_tokens_details"]["cached_tokens"] > 0 for usage, _, _ in rows[1:])
    filled = next(k for k, (_, tokens, _) in enumerate(rows) if tokens > BUDGET)
    assert 0 < filled < TURNS - 2  # some turns before the budget fills, several after
    assert rows[filled - 1][2] < rows[filled][2]  # the state grew until then
    assert len({size for _, _, size in rows[filled:]}) == 1, [size for _, _, size in rows]
