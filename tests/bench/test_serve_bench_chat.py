"""``serve-bench --profile chat`` (bench/chat.py) on a tiny model: conversations of several turns,
each policy with the prefix store and without; the store's runs read only the new turn's tokens."""

import pytest

import h2okv.eval.qa_data as qa_data
from h2okv.bench.chat import ChatBenchOptions, chat_bench, conversations
from h2okv.tools.tiny_chat import tiny_chat_model
from qa_requests import coqa_docs, install


@pytest.fixture
def coqa(tmp_path, monkeypatch):
    """CoQA's request file, generated (CI has no `make eval-data`): 24 stories of 5 turns."""
    install(tmp_path / "oe_eval_tasks", monkeypatch, coqa=coqa_docs())
    yield
    qa_data.read_docs.cache_clear()


TEXT = ". ".join(f"Sentence number {i} of a long and quiet essay about nothing in particular" for i in range(400))


def test_turns_after_the_first_resume_with_the_store_and_reread_without():
    model, tok = tiny_chat_model(layers=2, max_positions=2048)
    options = ChatBenchOptions(policies=("h2o",), kv_memory=64 << 20, conversations=2, turns=2, doc_tokens=150,
                               max_tokens=4, prefix_memory=64 << 20, concurrency=2,
                               budget={"heavy_ratio": 0.1, "recent_ratio": 0.1}, prefill_chunk=64, model_name="tiny")
    result = chat_bench(model, tok, options, progress=lambda line: None, source=TEXT)
    store, none = result["results"]
    assert (store["prefix_cache_memory"], none["prefix_cache_memory"]) == (64 << 20, 0)
    assert store["answered"] == none["answered"] == 4
    assert store["prefix_hits"] >= 2 and none["prefix_hits"] == 0 and store["prefix_bytes"] > 0
    second = store["turns"][1]
    assert second["read_tokens_mean"] < second["prompt_tokens_mean"] / 2  # only the new turn is read
    assert none["turns"][1]["read_tokens_mean"] == none["turns"][1]["prompt_tokens_mean"]


def test_every_conversation_hides_one_number_per_turn():
    model, tok = tiny_chat_model(layers=1)
    convs = conversations(tok, 3, 100, 4, seed=1, source=TEXT)
    for conv in convs:
        assert len(conv["turns"]) == 4
        for turn in conv["turns"]:
            (number,) = turn["references"]
            key = turn["ask"].split(" for ", 1)[1].split("?")[0]
            assert f"The special magic number for {key} is {number}" in conv["system"]
            assert turn["metric"] == "string_match_all"


def test_coqa_chats_share_documents_and_ask_each_storys_own_questions_in_order(coqa):
    from h2okv.bench.doc_chat import coqa_chats
    from h2okv.eval.longctx.qa import half

    model, tok = tiny_chat_model(layers=1)
    convs = coqa_chats(tok, documents=2, per_document=3, turns=4, doc_tokens=1500, seed=1)
    assert [c["document"] for c in convs] == [0, 0, 0, 1, 1, 1]
    by_story = {c.story: c for c in qa_data.coqa_conversations()}
    test_half = {c.story for c in half(list(by_story.values()), 1, lambda c: c.story)}
    for conv in convs:
        same = [c for c in convs if c["document"] == conv["document"]]
        assert all(c["system"] == conv["system"] for c in same)  # one document, several conversations
        assert len({c["story"] for c in same}) == 3  # each about another story of it
        assert len(tok(conv["system"])["input_ids"]) >= 1500
        text = conv["system"].split(f"Story {conv['story']}:\n", 1)[1].split("\n\nStory ", 1)[0].strip()
        assert text in test_half  # the test split's half of CoQA
        gold = by_story[text].turns[:4]
        assert [t["references"] for t in conv["turns"]] == [list(g.answers) for g in gold]
        assert all(g.question in t["ask"] and (t["metric"], t["also"]) == ("qa_recall", "qa_f1")
                   for g, t in zip(gold, conv["turns"], strict=True))


def test_coqa_chats_refuse_what_the_data_cannot_give(coqa):
    from h2okv.bench.doc_chat import coqa_chats
    from h2okv.errors import H2OError

    model, tok = tiny_chat_model(layers=1)
    with pytest.raises(H2OError, match="conversations need more"):
        coqa_chats(tok, documents=400, per_document=3, turns=4, doc_tokens=100)


def test_a_coqa_chat_is_graded_turn_by_turn(coqa):
    from h2okv.bench.doc_chat import coqa_chats

    model, tok = tiny_chat_model(layers=2, max_positions=4096)
    convs = coqa_chats(tok, documents=1, per_document=2, turns=2, doc_tokens=300)
    options = ChatBenchOptions(policies=("full",), kv_memory=64 << 20, conversations=2, turns=2, doc_tokens=300,
                               max_tokens=4, prefix_memory=64 << 20, concurrency=2, model_name="tiny")
    result = chat_bench(model, tok, options, progress=lambda line: None, convs=convs)
    store = result["results"][0]
    assert store["answered"] == 4 and store["prefix_hits"] >= 2  # the second turns resume, and so may a shared document
    rows = store["rows"]
    assert {(r["document"], r["turn"]) for r in rows} == {(0, 1), (0, 2)}
    assert all(0.0 <= r["qa_f1"] <= 1.0 and 0.0 <= r["score"] <= 1.0 and r["correct"] == (r["score"] >= 0.5)
               for r in rows)
    assert store["turns"][0]["score_mean"] is not None


def test_a_recipe_runs_beside_the_policies_and_its_document_is_ranked_once():
    """``--recipe document``: the server of ``serve --recipe document`` (kvzip, cache-wide head split),
    given the profile's total budget. Its first turn ranks the document alone (the question is read
    after), so the second turn resumes the question-agnostic state and reads only what is new."""
    from h2okv.bench.serve import server_settings

    (label, eviction), = server_settings([], ["document"], {"heavy_ratio": 0.1, "recent_ratio": 0.1})
    settings = eviction.settings
    assert (label, settings.policy, settings.budget, settings.head_budgets) == ("document", "kvzip", 0.2, "layers")
    model, tok = tiny_chat_model(layers=2, max_positions=2048)
    options = ChatBenchOptions(policies=(), recipes=("document",), kv_memory=64 << 20, conversations=1, turns=2,
                               doc_tokens=150, max_tokens=4, prefix_memory=64 << 20, concurrency=1,
                               budget={"heavy_ratio": 0.1, "recent_ratio": 0.1}, prefill_chunk=64, model_name="tiny")
    result = chat_bench(model, tok, options, progress=lambda line: None, source=TEXT)
    store, none = result["results"]
    assert store["policy"] == none["policy"] == "document"
    assert store["answered"] == none["answered"] == 2
    assert store["prefix_hits"] >= 1 and none["prefix_hits"] == 0
    assert store["turns"][1]["read_tokens_mean"] < store["turns"][1]["prompt_tokens_mean"] / 2


def test_the_per_turn_plot_draws_every_run(tmp_path):
    import pytest

    from h2okv.bench.chat import plot_chat
    from h2okv.errors import H2OError

    turns = [{"turn": t, "ttft_median_s": s} for t, s in ((1, 60.0), (2, 1.2), (3, None))]
    rows = [{"policy": name, "prefix_cache_memory": store, "turns": turns, "correct": 3, "answered": 3}
            for name in ("full", "document") for store in (1 << 20, 0)]
    path = plot_chat(rows, str(tmp_path / "turns.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(H2OError, match=".png"):
        plot_chat(rows, str(tmp_path / "turns.svg"))
