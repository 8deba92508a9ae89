"""Where a chat's cacheable prefix ends (``h2okv.chat.history_length``; the server's for
``/v1/chat/completions``, ``Serving.cacheable_prefix``), for two chat templates of different styles:

- the embedded default model's own (SmolLM2-135M-Instruct: ChatML, a default system message when
  the conversation has none);
- Llama-3's (a BOS token, role headers, every message ``trim``med), on the tiny byte-level
  tokenizer. (Qwen2.5's template renders as SmolLM2's does, ChatML, and the local Gemma-3 GGUF
  carries no chat template, so the second style is written here, as Llama-3-8B-Instruct's renders.)

In every case the prefix is exactly the tokens of every message before the last user message as
the template renders them alone, or None when the prompt does not start with those tokens. A
template that renders an earlier turn otherwise once a later one follows (one that strips an
earlier answer's reasoning, as Qwen3's does) has no prefix there: that is documented here too.
"""

import copy

import pytest

from h2okv.chat import encode_text, history_length
from h2okv.tools.tiny import tiny_model
from h2okv.tools.tiny_chat import tiny_tokenizer

# Llama-3-Instruct's layout (its template's rendering, not its text)
LLAMA3_TEMPLATE = (
    "{%- for m in messages %}{%- if loop.first %}{{ bos_token }}{%- endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# ChatML that, as Qwen3's template does, drops an answer's reasoning once a later user message follows it
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SYSTEM = {"role": "system", "content": "You answer questions about this note. The garden behind the old mill "
                                       "has three apple trees, a pond and a bench painted blue in 1998."}
U1 = {"role": "user", "content": "How many apple trees are there?"}
A1 = {"role": "assistant", "content": "There are three apple trees."}
U2 = {"role": "user", "content": "And what colour is the bench?"}
A2 = {"role": "assistant", "content": "The bench is blue."}
U3 = {"role": "user", "content": "When was it painted?"}
STYLES = ["smollm2", "llama3"]


def byte_tokenizer(template: str, **specials):
    """The tiny byte-level tokenizer (a copy: the cached one serves other tests) with ``template``."""
    tok = copy.deepcopy(tiny_tokenizer())
    if specials:
        tok.add_special_tokens(specials)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def llama3_tokenizer():
    return byte_tokenizer(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                          additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])


@pytest.fixture(params=STYLES)
def style(request):
    """``(name, tokenizer)``: the embedded model's real one, or Llama-3's layout on bytes."""
    if request.param == "smollm2":
        return "smollm2", request.getfixturevalue("default_model")[1]
    return "llama3", request.getfixturevalue("llama3_tokenizer")


def render(tok, messages, generation: bool = False) -> list[int]:
    """The template's own ids for ``messages`` (with the assistant's opening when ``generation``)."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation, return_dict=True)["input_ids"])


def text(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False)


def prefix(tok, messages) -> int | None:
    """The prefix of the prompt the server builds for ``messages`` (``Serving.tokenize``)."""
    return history_length(tok, messages, render(tok, messages, generation=True))


def assert_history(tok, messages, history):
    """The prefix of ``messages``' prompt is ``history`` as the template renders it alone: the same ids,
    and the same text (the boundary falls between two of the template's pieces, not inside a token)."""
    prompt = render(tok, messages, generation=True)
    n = history_length(tok, messages, prompt)
    assert n == len(render(tok, history)) and 0 < n < len(prompt)
    assert prompt[:n] == render(tok, history)
    assert tok.decode(prompt[:n]) == text(tok, history)


def test_one_turn_the_prefix_is_the_system_message(style):
    name, tok = style
    assert_history(tok, [SYSTEM, U1], [SYSTEM])
    head = {"smollm2": "<|im_start|>system\n", "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"}
    tail = {"smollm2": "<|im_end|>\n", "llama3": "<|eot_id|>"}
    assert text(tok, [SYSTEM]) == head[name] + SYSTEM["content"] + tail[name]
    # no message before the user's: no prefix (SmolLM2's default system message is the template's, not the chat's)
    assert prefix(tok, [U1]) is None


def test_several_turns_the_prefix_is_every_message_before_the_last_user_message(style):
    _, tok = style
    assert_history(tok, [SYSTEM, U1, A1, U2], [SYSTEM, U1, A1])
    assert_history(tok, [SYSTEM, U1, A1, U2, A2, U3], [SYSTEM, U1, A1, U2, A2])
    assert_history(tok, [U1, A1, U2], [U1, A1])  # no system message


def test_the_next_turn_starts_with_the_previous_prompt_and_answer(style):
    """What the store resumes: a turn's saved state is its prompt and answer as fed; the next turn's
    prompt starts with exactly those ids (then the end of the answer's turn), and its prefix ends after
    that turn. Both templates guarantee it for an answer with no surrounding whitespace."""
    _, tok = style
    turns = [SYSTEM, U1, A1, U2, A2, U3]
    for last in (2, 4):  # the user message a turn answers
        before, after = turns[:last], turns[:last + 2]
        fed = render(tok, before, generation=True) + encode_text(tok, turns[last]["content"])
        prompt = render(tok, after, generation=True)
        assert prompt[:len(fed)] == fed
        assert history_length(tok, after, prompt) == len(render(tok, turns[:last + 1])) > len(fed)


def test_llama3_trims_an_answer_so_its_ids_are_not_resumed(llama3_tokenizer):
    """Llama-3's template trims every message: an answer that ends with whitespace (as generated) is
    rendered without it in the next turn, whose prompt then does not start with the previous prompt
    and answer (that turn's saved state is not resumed); the history's own prefix is still right."""
    tok = llama3_tokenizer
    answer = {"role": "assistant", "content": A1["content"] + "\n"}
    fed = render(tok, [SYSTEM, U1], generation=True) + encode_text(tok, answer["content"])
    prompt = render(tok, [SYSTEM, U1, answer, U2], generation=True)
    assert prompt[:len(fed)] != fed
    assert_history(tok, [SYSTEM, U1, answer, U2], [SYSTEM, U1, answer])


def test_an_edited_earlier_message_moves_the_prefix(style):
    """An edited earlier message: the prefix is the edited history's rendering, and the edited
    prompt does not start with the original history (whose stored state it must not resume)."""
    _, tok = style
    edited = {"role": "user", "content": "How many pear trees are there?"}
    original, changed = [SYSTEM, U1, A1, U2], [SYSTEM, edited, A1, U2]
    assert_history(tok, changed, [SYSTEM, edited, A1])
    assert render(tok, [SYSTEM, edited, A1]) != render(tok, [SYSTEM, U1, A1])
    prompt = render(tok, changed, generation=True)
    assert prompt[:len(render(tok, original[:3]))] != render(tok, original[:3])
    assert history_length(tok, original, prompt) is None


def test_a_history_ending_with_an_assistant_turn(style):
    """Messages that end with an assistant turn: the history is what precedes the last user message
    (the assistant turn after it is part of the rest, as the question is)."""
    _, tok = style
    assert_history(tok, [SYSTEM, U1, A1], [SYSTEM])
    assert_history(tok, [SYSTEM, U1, A1, U2, A2], [SYSTEM, U1, A1])
    assert prefix(tok, [U1, A1]) is None


def test_a_prompt_that_does_not_start_with_the_history_has_none(style):
    _, tok = style
    messages = [SYSTEM, U1, A1, U2]
    other = [{"role": "system", "content": "Another note."}, U1, A1, U2]
    assert history_length(tok, messages, render(tok, other, generation=True)) is None
    history = render(tok, messages[:3])
    assert history_length(tok, messages, history) is None  # the history alone: no token left to read
    assert history_length(tok, messages, []) is None


def test_a_template_that_strips_earlier_reasoning_has_no_prefix():
    """Documented limitation: a template that renders an earlier answer otherwise once a later user
    message follows (Qwen3-style: its reasoning dropped) gives no prefix point, and its next turn
    does not start with the previous prompt and answer; nothing is resumed (never a wrong state)."""
    tok = byte_tokenizer(REASONING_TEMPLATE)
    answer = {"role": "assistant", "content": "<think>\ncount them\n</think>\n\nThere are three."}
    messages = [SYSTEM, U1, answer, U2]
    prompt = render(tok, messages, generation=True)
    assert history_length(tok, messages, prompt) is None
    fed = render(tok, [SYSTEM, U1], generation=True) + encode_text(tok, answer["content"])
    assert prompt[:len(fed)] != fed
    assert_history(tok, [SYSTEM, U1], [SYSTEM])  # the first turn's system message still is a prefix
    plain = [SYSTEM, U1, {"role": "assistant", "content": "There are three."}, U2]
    assert_history(tok, plain, plain[:3])  # and an answer with no reasoning is rendered alike


@pytest.fixture
def served(style):
    """``(name, tokenizer, model)``: the real SmolLM2 for its own template, a tiny random Llama for Llama-3's."""
    name, tok = style
    if name == "smollm2":
        return name, tok, None
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       max_position_embeddings=2048)
    return name, tok, model


def test_the_server_saves_a_chat_at_its_history(served, request):
    """Through the API: each turn's state is stored at its cacheable prefix, whose ids are exactly the
    template's rendering of its history, and the next turn resumes (``cached_tokens``) at least that
    history; with the real model's answer (greedy, natural text), the whole previous prompt and answer."""
    import openai

    from h2okv.serve import create_app, running_server
    from h2okv.serve.engine import EngineOptions

    name, tok, model = served
    if model is None:
        model = request.getfixturevalue("default_model")[0]
    app = create_app(model, tok, model_name=name, options=EngineOptions(prefill_chunk=16, prefix_memory=64 << 20))
    engine = app.state.engine
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(messages):
            out = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
            return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens

        first = [SYSTEM, U1]
        answer, cached = ask(first)
        assert cached == 0
        stored = {entry.ids for entry in engine.prefixes}
        assert tuple(render(tok, [SYSTEM])) in stored
        fed = render(tok, first, generation=True)
        assert any(ids[:len(fed)] == tuple(fed) and len(ids) == len(fed) + 7 for ids in stored)  # prompt + answer
        second = [*first, {"role": "assistant", "content": answer}, U2]
        _, cached = ask(second)
        assert tuple(render(tok, second[:3])) in {entry.ids for entry in engine.prefixes}
        assert cached >= len(render(tok, [SYSTEM]))
        if name == "smollm2":  # the answer's text encodes back to the ids it was generated as
            assert cached == len(fed) + 7
