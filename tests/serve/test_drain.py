"""SIGTERM drains a real ``h2okv serve`` process (tiny checkpoint on disk, 127.0.0.1, a free port):
admission stops with 503, running requests finish (or, past --drain-timeout, end with a final
event), and the process exits 0."""

import threading

import openai
import pytest

from h2okv.tools.process import ServerProcess, save_tiny_model

NAME = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_chat"), layers=2, max_positions=4096)


def start(checkpoint, tmp_path, *extra):
    server = ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME, "--log-level", "warning",
                            "--chunk-size", "32", *extra], log_path=tmp_path / "server.log")
    server.wait_healthy()
    return server


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def stream_in_thread(server, max_tokens, result):
    def run():
        try:
            stream = client(server).completions.create(model=NAME, prompt="drain me", max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True})
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                result["started"].set()
            result["chunks"] = chunks
        except Exception as exc:
            result["error"] = exc
        finally:
            result["started"].set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_drains_and_exits_0(checkpoint, tmp_path):
    """One process (startup is the slow part): a short stream finishes in full after SIGTERM, a long
    one is ended by --drain-timeout with a final error event, a new request gets 503, exit status 0."""
    with start(checkpoint, tmp_path, "--drain-timeout", "4") as server:
        short, long = {"started": threading.Event()}, {"started": threading.Event()}
        threads = [stream_in_thread(server, 60, short), stream_in_thread(server, 4000, long)]
        assert short["started"].wait(60) and long["started"].wait(60)
        assert "error" not in short and "error" not in long
        server.terminate()
        with pytest.raises(openai.APIStatusError) as info:  # admission has stopped
            for _ in range(100):  # bounded: the drain flag is set within a moment of the signal
                client(server).completions.create(model=NAME, prompt="late", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "shutting_down"
        for thread in threads:
            thread.join(120)
        assert "error" not in short, short.get("error")
        chunks = short["chunks"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 60
        # the long stream ended with an error event (not a cut connection): the client raises it
        assert isinstance(long.get("error"), openai.APIError) and "shutting down" in str(long["error"])
        assert server.wait(60) == 0
