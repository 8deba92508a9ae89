"""``h2okv serve --tp 2`` on CPU with gloo: a tiny random Qwen2 with 4 KV heads (2 per rank) answers
the official ``openai`` client with the same greedy text as a ``--tp 1`` server of the same
checkpoint, resumes a conversation from its prefix store with every rank keeping the same saved
entries, frees every rank's KV after cancelled streams, and ends every rank with exit 0 on SIGTERM.

Starting ranks is the slow part (each imports torch and transformers): the server is the last step
of the session's one 2-rank group (``tp_group``, tests/support/tp_group.py), which runs
``cli.main(["serve", ..., "--tp", "2"])`` on both ranks after the checks of test_distributed.py.
The SIGTERM test stops it and therefore runs last (file order). The tests after it need no ranks:
what rank 0 does when its group breaks, and the launcher's signal hand-off.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from h2okv import cli
from h2okv.bench.serve import scrape
from h2okv.models import load_model
from h2okv.parallel import launch
from h2okv.serve import EvictionDefaults, create_app, running_server, tp
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.executor import Executor
from h2okv.tools.process import save_tiny_model
from h2okv.tools.tiny_chat import tiny_chat_model
from tp_group import SERVE_CHUNK, SERVE_CONTEXT, SERVE_HEAVY, SERVE_NAME, SERVE_PREFIX_MEMORY, SERVE_RECENT

NAME = SERVE_NAME
PROMPTS = [f"prompt {i}: the quick brown fox jumps over {i * 7} lazy dogs" for i in range(8)]


@pytest.fixture(scope="module")
def tp2(tp_group):
    """The group's ``serve --tp 2``, healthy; ``.ranks`` = [rank 0, rank 1] pids."""
    return tp_group.serve()


@pytest.fixture(scope="module")
def tp1(tp_group):
    """The same checkpoint and settings served by one process, in this one (no rank to start)."""
    model, tok = load_model(str(tp_group.checkpoint), cache=False)
    app = create_app(model, tok, model_name=NAME,
                     eviction=EvictionDefaults.from_options(policy="h2o", heavy=SERVE_HEAVY, recent=SERVE_RECENT),
                     options=EngineOptions(prefill_chunk=SERVE_CHUNK, prefix_memory=SERVE_PREFIX_MEMORY))
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of the served architecture for the bad-settings tests (no group needed)."""
    return save_tiny_model(tmp_path_factory.mktemp("tp_chat"), arch="qwen2", num_key_value_heads=4,
                           max_positions=1024)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(url: str, prompt: str, max_tokens: int = 16) -> str:
    out = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def stream_chat(url: str, content: str, max_tokens: int = 16) -> str:
    stream = client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                                 max_tokens=max_tokens, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return "".join(parts)


def rank_gauges(url: str) -> dict[str, dict[int, float]]:
    """``/metrics`` per-rank gauges: {name: {rank: value}}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "rank" in sample.labels:
                out.setdefault(sample.name, {})[int(sample.labels["rank"])] = sample.value
    return out


@pytest.mark.slow
def test_completion_matches_tp1(tp2, tp1):
    prompt = PROMPTS[0] * 2  # longer than the budget and several chunks: prefill evicts
    assert complete(tp2.url, prompt) == complete(tp1, prompt)


@pytest.mark.slow
def test_streamed_chat_matches_tp1(tp2, tp1):
    assert stream_chat(tp2.url, PROMPTS[1]) == stream_chat(tp1, PROMPTS[1])


@pytest.mark.slow
def test_eight_concurrent_streams_match_tp1(tp2, tp1):
    """8 streams at once: rows join and leave the decode batch of every rank while others decode."""
    with ThreadPoolExecutor(8) as pool:
        tp2_texts = list(pool.map(lambda i: stream_chat(tp2.url, PROMPTS[i], 8 + 2 * i), range(8)))
    tp1_texts = [stream_chat(tp1, PROMPTS[i], 8 + 2 * i) for i in range(8)]
    assert tp2_texts == tp1_texts
    assert all(tp2_texts)


@pytest.mark.slow
def test_kvzip_completion_matches_tp1(tp2, tp1):
    """A prompt ranked by reconstruction: every rank reads the same probe on its own KV heads."""
    def run(url):
        out = client(url).completions.create(model=NAME, prompt=PROMPTS[2] * 2, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True, "h2o": {"policy": "kvzip"}})
        return out.choices[0].text

    assert run(tp2.url) == run(tp1)


def converse(url: str) -> list[tuple[str, int]]:
    """A two-turn chat over a shared system document: each turn's (answer, cached prompt tokens)."""
    system = {"role": "system", "content": "Read this note first: " + "the mill pond freezes in January. " * 4}
    history, turns = [system, {"role": "user", "content": "when does the pond freeze?"}], []
    for question in ("and when does it thaw?", None):
        out = client(url).chat.completions.create(model=NAME, messages=history, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
        turns.append((out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens))
        if question:
            history += [{"role": "assistant", "content": turns[-1][0]}, {"role": "user", "content": question}]
    return turns


@pytest.mark.slow
def test_a_conversation_resumes_on_every_rank_and_every_rank_keeps_the_same_entries(tp2, tp1):
    """With the prefix store: the second turn resumes a saved state (each rank its own KV heads of
    it), answers as one process with the same store does, and afterwards every rank holds the same
    saved entries (their count and a checksum of their ids), the ones rank 0's index lists.

    Their bytes are rank 0's in the index, and close on the other rank but not equal: a saved copy
    is trimmed past its last live slot, and where that falls depends on which slots this rank's KV
    heads evicted (seen: rank 1 held 129,024 bytes where rank 0 held 129,280, one slot of one layer)."""
    hits = scrape(tp2.url).get("h2okv_prefix_cache_hits_total", 0)
    turns = converse(tp2.url)
    assert turns[0][1] == 0 and turns[1][1] > 0  # the second turn read only what follows a saved state
    assert turns == converse(tp1)  # the same answers, resumed at the same point
    deadline = time.monotonic() + 30
    while True:  # the engine publishes its store's figures once its iteration ends
        store, ranks = scrape(tp2.url), rank_gauges(tp2.url)
        if ranks["h2okv_rank_prefix_cache_entries"][0] == store["h2okv_prefix_cache_entries"]:
            break
        assert time.monotonic() < deadline, (store, ranks)
        time.sleep(0.2)
    assert store["h2okv_prefix_cache_hits_total"] >= hits + 1
    entries, size = store["h2okv_prefix_cache_entries"], store["h2okv_prefix_cache_bytes"]
    assert entries >= 3 and size > 0  # this conversation's: the document, turn 1, turn 2's history, turn 2
    assert ranks["h2okv_rank_prefix_cache_entries"] == {0: entries, 1: entries}
    held = ranks["h2okv_rank_prefix_cache_bytes"]
    assert held[0] == size and abs(held[1] - size) <= 0.1 * size
    checksum = ranks["h2okv_rank_prefix_cache_checksum"]
    assert checksum[0] == checksum[1] and set(checksum) == {0, 1}


@pytest.mark.slow
def test_every_rank_holds_kv_while_streaming_and_none_after_cancellations(tp2):
    """Streams closed early are cancelled on rank 0, and the followers drop the same rows: every
    rank ends with no sequence and no KV bytes. While they run, both ranks hold the same bytes.
    The streams ask for more tokens than any machine decodes while the ranks are looked at (800
    could end first on a fast machine), so all four are running then."""
    held: list[dict] = []
    started = threading.Barrier(5)
    never_ends = SERVE_CONTEXT - 100  # (the served checkpoint's context: the prompts are shorter than 100)

    def read_then_close(i: int) -> None:
        stream = client(tp2.url).completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=never_ends,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 3:
                started.wait(60)  # all four stream: look at the ranks
                started.wait(60)  # the main thread has looked
                break
        stream.close()  # the client goes away mid-generation

    threads = [threading.Thread(target=read_then_close, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    held.append(rank_gauges(tp2.url))
    started.wait(60)
    for t in threads:
        t.join(60)
    during = held[0]
    assert during["h2okv_rank_sequences"] == {0: 4, 1: 4}
    assert during["h2okv_rank_kv_bytes_in_use"][0] == during["h2okv_rank_kv_bytes_in_use"][1] > 0
    deadline = time.monotonic() + 30
    while True:
        after = rank_gauges(tp2.url)
        if all(v == 0 for name in ("h2okv_rank_sequences", "h2okv_rank_kv_bytes_in_use") for v in after[name].values()):
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert set(after["h2okv_rank_sequences"]) == {0, 1}
    metrics = httpx.get(tp2.url + "/metrics", timeout=30).text
    assert float(re.search(r'h2okv_requests_finished_total\{outcome="cancelled"\} (\S+)', metrics)[1]) >= 4
    # the server still answers as before
    assert complete(tp2.url, PROMPTS[2], 4)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--tp", "3"], "has 4 KV heads, which do not divide by 3"),
        (["--tp", "2", "--kv-memory", "lots"], "--kv-memory"),
        (["--tp", "2", "--port", "0"], "--port must be in 1..65535"),
        (["--tp", "0"], "must be a positive integer (> 0)"),
    ],
)
def test_bad_serve_tp_settings_one_line_exit_2(checkpoint, capsys, argv, fragment):
    assert cli.main(["serve", "--model", str(checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_drains_and_ends_every_rank_with_exit_0(tp2):
    """Runs last: stops the group's server. A stream running at SIGTERM finishes, then rank 0 and
    the follower exit, and the launcher returns 0 (which it does only when every rank exited 0)."""
    ranks = tp2.ranks
    assert len(ranks) == 2
    result: dict = {}
    started = threading.Event()

    def stream() -> None:
        try:
            chunks = client(tp2.url).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=40, temperature=0,
                                                        stream=True, extra_body={"ignore_eos": True})
            finish = None
            for chunk in chunks:
                started.set()
                finish = chunk.choices[0].finish_reason or finish
            result["finish"] = finish
        except Exception as exc:
            result["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    tp2.terminate()
    thread.join(60)
    assert result == {"finish": "length"}
    assert tp2.wait(60) == 0 and not tp2.thread.is_alive()
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists()


class BreakingChannel:
    """A channel to no follower, whose group breaks after ``ok`` sends (what ``tp.Channel`` does when
    a peer is gone: it records the error and every later send raises ``GroupBroken``)."""

    def __init__(self, ok: int):
        self.lock, self.previous_ok, self.ok, self.broken, self.sent = threading.RLock(), True, ok, None, []

    def send(self, kind, payload=None):
        if self.broken is not None or len(self.sent) >= self.ok:
            self.broken = self.broken or RuntimeError("gloo: connection reset by peer")
            raise tp.GroupBroken(f"the tensor-parallel group is broken: {self.broken}")
        self.sent.append((kind, payload and payload[0]))

    def fail(self, exc):
        self.broken = self.broken or exc


def test_the_channel_names_real_executor_methods():
    """LOCAL_ONLY and CACHE_ONLY name the executor's methods: a rename in executor.py must not
    silently turn a read into a broadcast or a cleanup into a GroupBroken."""
    methods = {name for name, value in vars(Executor).items() if callable(value) and not name.startswith("_")}
    assert tp.CACHE_ONLY <= methods
    assert tp.LOCAL_ONLY - {"sequences"} <= methods
    assert not tp.CACHE_ONLY & tp.LOCAL_ONLY and {"prefill", "decode", "slot_bytes"} <= methods - tp.CACHE_ONLY


def test_requests_end_with_an_error_event_when_the_group_breaks():
    """Rank 0 with a broken group: the request's forward raises GroupBroken, the engine fails the
    request with a final error event (not a hang), its cleanup runs on rank 0 alone and frees
    rank 0's caches, and the engine keeps running (the server stops it)."""
    model, tok = tiny_chat_model(layers=2)
    channel = BreakingChannel(ok=2)  # the engine's slot_bytes measurement, then one open
    leader = tp.Leader(Executor(model, 16), channel)
    engine = Engine(model, tok, EngineOptions(prefill_chunk=16), executor=leader)
    assert channel.sent == [("call", "slot_bytes")]
    engine.start()
    try:
        handle = engine.submit(GenerationRequest(list(range(40)), 4, "h2o", 8, 8, temperature=0.0))
        _, final = handle.result_blocking(timeout=60)
        assert final.kind == "error" and "GroupBroken" in final.error.message
        assert channel.sent == [("call", "slot_bytes"), ("call", "open")]  # the prefill never went out
        deadline = time.monotonic() + 10
        while engine.executor.kv_bytes() or tp._open_sequences(leader._executor):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert engine.alive
    finally:
        engine.stop()


def test_launcher_passes_sigterm_and_sigint_to_rank_0():
    """The launcher of a server (``signals_to_rank0``) hands each SIGTERM or SIGINT it gets to rank 0
    as SIGTERM (rank 0 drains), and puts its own handlers back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        restore = launch._forward_signals(child.pid)
        assert set(restore) == {signal.SIGTERM, signal.SIGINT}  # installed (else the signal would hit pytest)
        try:
            os.kill(os.getpid(), sig)
            assert child.wait(30) == -signal.SIGTERM
        finally:
            for s, handler in restore.items():
                signal.signal(s, handler)
            child.kill()
    assert signal.getsignal(signal.SIGINT) is before


