"""Soak run: a real ``h2okv serve`` process under mixed, partly hostile traffic for a while.

``python -m h2okv.tools.soak --duration 600 --clients 64`` (``make soak``) starts the server on
127.0.0.1 (the tiny test model by default, ``--model`` for a real one) and runs ``--clients``
concurrent loops. Each loop sends, at random:

- valid streaming requests (completions or chat, mixed policies and budgets, sometimes ``n=2`` or
  logprobs), some of which the client abandons after a few chunks (a disconnect);
- valid edge requests, which must get a 200: a tiny temperature (greedy), policy options
  (``snapkv:window=4``, echoed back), ``n`` at the server's ``--max-n``;
- conversations (a share of the clients, ``--conversing``): chats of 2 to 4 streamed turns over a
  system document that several conversations share, each turn sending the history back with the
  previous answer, so the prefix store (``--prefix-cache-memory``, on by default and small, so it
  fills and evicts) resumes turns and documents; some turns are abandoned mid-stream;
- bad requests: malformed JSON, wrong values, huge ``max_tokens``, an empty prompt, invalid UTF-8,
  an unknown policy, an over-long prompt, and the hostile inputs the server was hardened against
  after probing it as an attacker would: a lone surrogate, a budget past the context, a body over
  ``--max-body-bytes``, bad policy options, wrong JSON types (``"max_tokens": "3"``), over-long or
  too many stop strings, ``n`` above the cap.

It checks: no 5xx at all; a 4xx in OpenAI's error format for every bad request; every completed
stream well formed; zero KV bytes and requests in use at the end (``/metrics``); with the store on,
that conversations resumed stored states (hits), that the store evicted and stayed within its
budget; the server's RSS
slope over the last ``--rss-window`` seconds (least squares, MiB per minute) at most
``--max-rss-slope``; and that SIGTERM then exits 0. Prints and optionally writes a JSON report;
exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from h2okv.bench.serve import scrape
from h2okv.sizes import parse_bytes
from h2okv.tools.process import ServerProcess, save_tiny_model

NAME = "soak"
MAX_PROMPT = 400
MAX_N = 8  # the server's --max-n
BIG_BODY = 6 << 20  # over the server's default --max-body-bytes (4 MiB)
POLICIES = [None, {"policy": "h2o"}, {"policy": "local", "heavy": 0, "recent": 16}, {"policy": "full"},
            {"policy": "sink", "heavy": 4, "recent": 12}, {"policy": "random", "heavy": 8, "recent": 8},
            {"heavy_ratio": 0.2, "recent_ratio": 0.2}]
WORDS = ["alpha", "beta", "gamma", "delta", "\u00e9t\u00e9", "\u4e2d\u6587"]
# the system documents conversations open with (several conversations share each: read once, resumed)
DOCUMENTS = [f"Document {i}. " + " ".join(random.Random(i).choice(WORDS) for _ in range(16)) for i in range(6)]


def bad_request(rng: random.Random) -> tuple[str, str, bytes]:
    """(kind, path, raw body) of a request the server must refuse with a 4xx."""
    kind = rng.choice(sorted(BAD_REQUESTS))
    path, body = BAD_REQUESTS[kind](rng)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # escapes lone surrogates
    return kind, path, raw


def _completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 4, **fields}


def _big_body(rng: random.Random) -> tuple[str, bytes]:
    padding = BIG_BODY + rng.randrange(1 << 20)
    return "/v1/completions", b'{"model": "soak", "max_tokens": 4, "prompt": "' + b"z" * padding + b'"}'


BAD_REQUESTS = {
    "malformed_json": lambda rng: ("/v1/completions",
                                   rng.choice([b'{"model": "soak", "prompt": "x"', b"{{}", b"not json", b""])),
    "wrong_values": lambda rng: _completion(max_tokens=rng.choice(["ten", [1], {"a": 1}, 1.5]), temperature="hot"),
    "huge_max_tokens": lambda rng: _completion(max_tokens=rng.choice([10**6, 10**30])),
    "empty_prompt": lambda rng: _completion(prompt=rng.choice(["", []])),
    "invalid_utf8": lambda rng: ("/v1/completions", b'{"model": "soak", "prompt": "\xff\xfe\xc3(", "max_tokens": 4}'),
    "unknown_policy": lambda rng: _completion(h2o={"policy": "lru-ish"}),
    "overlong_prompt": lambda rng: _completion(prompt=" y" * (MAX_PROMPT + 1 + rng.randrange(100))),
    "bad_messages": lambda rng: ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": 3}]}),
    # the hostile inputs the server was hardened against after probing it as an attacker would
    "lone_surrogate": lambda rng: rng.choice([
        _completion(prompt="a\ud800b"),
        ("/v1/chat/completions", {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "\udfff"}]})]),
    "huge_budget": lambda rng: _completion(h2o={"heavy": rng.choice([10**30, 1 << 63, 4096]), "recent": 4}),
    "big_body": _big_body,
    "bad_policy_option": lambda rng: _completion(h2o={"policy": rng.choice(["snapkv:window=x", "h2o:window=4",
                                                                            "snapkv:size=3"])}),
    "wrong_json_types": lambda rng: _completion(**rng.choice([{"max_tokens": "3"}, {"n": "2"}, {"stream": "yes"},
                                                              {"logprobs": True}, {"temperature": "0"}])),
    "overlong_stop": lambda rng: _completion(stop=rng.choice([["s" * (1 << 20)], "s" * 300, list("abcdef")])),
    "n_over_cap": lambda rng: _completion(n=MAX_N + 1 + rng.randrange(8)),
}


def edge_request(rng: random.Random) -> tuple[str, dict, dict]:
    """(kind, body, what the 200 answer must show) of a valid request at an edge of the schema."""
    kind = rng.choice(["tiny_temperature", "policy_option", "n_at_cap"])
    _, body = _completion(prompt="edge " * rng.randint(1, 20), max_tokens=rng.randint(1, 8))
    expect: dict = {"choices": 1}
    if kind == "tiny_temperature":
        body["temperature"] = rng.choice([1e-40, 5e-324, 1e-6])
    elif kind == "policy_option":
        body["h2o"] = {"policy": "snapkv:window=4", "heavy": 4, "recent": 4}
        expect["policy"] = "snapkv:window=4,kernel=7"
    else:
        body["n"] = expect["choices"] = MAX_N
    return kind, body, expect


def valid_request(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.3
    body: dict = {"model": NAME, "max_tokens": rng.randint(1, 96), "stream": True,
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 30),
                  "stream_options": {"include_usage": True}, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.1:
        body["n"] = 2
    if (policy := rng.choice(POLICIES)) is not None:
        body["h2o"] = policy
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", body
    body["prompt"] = text
    if rng.random() < 0.2:
        body["logprobs"] = 2
    return "/v1/completions", body


class Tally:
    def __init__(self):
        self.counts: Counter = Counter()
        self.failures: list[str] = []

    def status(self, code: int) -> None:
        if code >= 500:
            self.counts["status_5xx"] += 1

    def fail(self, message: str) -> None:
        self.counts["failures"] += 1
        if len(self.failures) < 20:
            self.failures.append(message)


async def send_valid(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = valid_request(rng)
    disconnect_after = rng.randint(1, 5) if rng.random() < 0.2 else None
    await stream(client, path, body, tally, disconnect_after)


async def stream(client: httpx.AsyncClient, path: str, body: dict, tally: Tally,
                 disconnect_after: int | None) -> tuple[str, dict] | None:
    """Send a streamed request and read it to its end: (choice 0's text, the usage chunk), or None
    (a failure, tallied; a 429; a disconnect after ``disconnect_after`` events)."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code == 429:  # queue full: a 4xx a client is told to retry, not a failure
            tally.counts["valid_429"] += 1
            return None
        if response.status_code != 200:
            detail = (await response.aread())[:200]
            tally.status(response.status_code)
            tally.fail(f"valid request got HTTP {response.status_code}: {detail!r}")
            return None
        events, finished, done, parts, usage = 0, 0, False, [], {}
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                tally.fail(f"not an SSE line: {line[:80]!r}")
                return None
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                tally.fail(f"error event for a valid request: {event['error']}")
                return None
            events += 1
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                finished += bool(choice.get("finish_reason"))
                if choice.get("index") == 0:
                    parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if disconnect_after is not None and events >= disconnect_after:
                tally.counts["valid_disconnected"] += 1
                return None  # leaving the block closes the connection mid-stream
        if not done or finished != body.get("n", 1) or not usage:
            tally.fail(f"incomplete stream: done={done}, finish reasons {finished}, usage {usage}")
            return None
        tally.counts["valid_completed"] += 1
        return "".join(parts), usage


async def converse(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    """One conversation: a shared document, then 2 to 4 turns, each sending the history with the
    previous answer (same policy and budget throughout, as one client's chat would)."""
    messages = [{"role": "system", "content": rng.choice(DOCUMENTS)}]
    policy = rng.choice(POLICIES)
    for turn in range(rng.randint(2, 4)):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "?"
        messages.append({"role": "user", "content": question})
        body: dict = {"model": NAME, "messages": messages, "max_tokens": rng.randint(4, 24), "stream": True,
                      "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 30),
                      "stream_options": {"include_usage": True}, "ignore_eos": rng.random() < 0.5}
        if policy is not None:
            body["h2o"] = policy
        disconnect_after = rng.randint(1, 3) if rng.random() < 0.1 else None
        answer = await stream(client, "/v1/chat/completions", body, tally, disconnect_after)
        if answer is None:
            return
        text, usage = answer
        tally.counts["conversation_turns"] += 1
        if turn and usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0:
            tally.counts["conversation_turns_resumed"] += 1
        if usage["prompt_tokens"] + usage["completion_tokens"] + 96 > MAX_PROMPT:
            break  # the next turn would not fit --max-prompt-tokens
        messages.append({"role": "assistant", "content": text})
    tally.counts["conversations_completed"] += 1


async def send_bad(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind, path, raw = bad_request(rng)
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    tally.counts[f"bad_{kind}"] += 1
    tally.status(response.status_code)
    try:
        error = response.json()["error"]
        well_formed = set(error) == {"message", "type", "param", "code"} and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        well_formed = False
    if not 400 <= response.status_code < 500 or not well_formed:
        tally.fail(f"bad request {kind} got HTTP {response.status_code}: {response.text[:200]!r}")


async def send_edge(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind, body, expect = edge_request(rng)
    response = await client.post("/v1/completions", content=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    tally.status(response.status_code)
    if response.status_code == 429:
        tally.counts["valid_429"] += 1
        return
    tally.counts[f"edge_{kind}"] += 1
    try:
        answer = response.json()
        shown = {"choices": len(answer["choices"])}
        if "policy" in expect:
            shown["policy"] = answer["h2o"]["policy"]
    except (ValueError, KeyError, TypeError):
        shown = {}
    if response.status_code != 200 or shown != expect:
        tally.fail(f"edge request {kind} got HTTP {response.status_code} ({shown} for {expect}): "
                   f"{response.text[:200]!r}")


async def client_loop(url: str, seed: int, stop_at: float, tally: Tally, conversing: bool = False) -> None:
    """One client until ``stop_at``: bad, edge and valid requests at random; a ``conversing`` client
    holds conversations where another sends single valid requests."""
    rng = random.Random(seed)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        while time.monotonic() < stop_at:  # bounded by the duration
            try:
                draw = rng.random()
                if draw < 0.2:
                    await send_bad(client, rng, tally)
                elif draw < 0.25:
                    await send_edge(client, rng, tally)
                elif conversing:
                    await converse(client, rng, tally)
                else:
                    await send_valid(client, rng, tally)
            except httpx.HTTPError as exc:
                tally.fail(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)


async def sample_rss(server: ServerProcess, stop_at: float, samples: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while time.monotonic() < stop_at:
        samples.append((time.monotonic() - start, server.rss_bytes()))
        await asyncio.sleep(1.0)


async def run_load(server: ServerProcess, clients: int, duration: float, seed: int,
                   conversing: float = 0.0) -> tuple[Tally, list]:
    """``clients`` loops, the first ``conversing`` share of them (rounded) holding conversations."""
    tally, rss = Tally(), []
    stop_at = time.monotonic() + duration
    talkers = round(clients * conversing)
    await asyncio.gather(sample_rss(server, stop_at, rss),
                         *(client_loop(server.url, seed * 1000 + i, stop_at, tally, i < talkers)
                           for i in range(clients)))
    return tally, rss


def rss_window(samples: list[tuple[float, int]], start: float, stop: float) -> int | None:
    window = [rss for t, rss in samples if start <= t < stop]
    return int(statistics.median(window)) if window else None


def rss_slope(samples: list[tuple[float, int]], start: float) -> float | None:
    """Least-squares slope of RSS over the samples from ``start`` seconds on, in MiB per minute (a
    leak shows as a steady slope; the first minutes, when allocator pools fill, are left out)."""
    window = [(t, rss) for t, rss in samples if t >= start]
    if len(window) < 3:
        return None
    slope = statistics.linear_regression([t for t, _ in window], [rss for _, rss in window]).slope
    return slope * 60 / 2**20


def run_server(args, tmp: str) -> tuple[Tally, list, float, dict, int]:
    """Serve, load, wait for the running requests to end, SIGTERM: (tally, RSS samples, seconds of
    load, the last /metrics, the exit status)."""
    model = args.model or str(save_tiny_model(Path(tmp) / "model", layers=2, max_positions=2048))
    server_args = ["--model", model, "--served-model-name", NAME, "--log-level", "warning",
                   "--kv-memory", args.kv_memory, "--max-batch", "48", "--max-queue", "128", "--max-n", str(MAX_N),
                   "--max-prompt-tokens", str(MAX_PROMPT), "--chunk-size", "64", "--request-timeout", "60"]
    if args.prefix_memory:
        server_args += ["--prefix-cache-memory", str(args.prefix_memory)]
    with ServerProcess(server_args, log_path=Path(tmp) / "server.log") as server:
        server.wait_healthy()
        started = time.monotonic()
        tally, rss = asyncio.run(run_load(server, args.clients, args.duration, args.seed, args.conversing))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        metrics = scrape(server.url)
        while (metrics["h2okv_requests_running"] or metrics["h2okv_requests_waiting"]) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
            metrics = scrape(server.url)
        server.terminate()
        return tally, rss, elapsed, metrics, server.wait(60)


def soak(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="h2okv-soak-") as tmp:
        tally, rss, elapsed, metrics, exit_code = run_server(args, tmp)
    minute = min(60.0, elapsed / 2)
    first = rss_window(rss, 0, minute)
    last = rss_window(rss, elapsed - minute, elapsed + 1)
    window = min(args.rss_window, 0.8 * elapsed)
    slope = rss_slope(rss, elapsed - window)
    counts = dict(sorted(tally.counts.items()))
    bad = sum(v for k, v in counts.items() if k.startswith("bad_"))
    checks = {
        "no_failures": tally.counts["failures"] == 0,
        "no_5xx": tally.counts["status_5xx"] == 0,
        "kv_bytes_in_use_zero": metrics["h2okv_kv_bytes_in_use"] == 0,
        "requests_running_zero": metrics["h2okv_requests_running"] == 0 and metrics["h2okv_requests_waiting"] == 0,
        "rss_slope_ok": slope is not None and slope <= args.max_rss_slope,
        "sigterm_exit_0": exit_code == 0,
        "traffic_seen": counts.get("valid_completed", 0) > 0 and bad > 0 and counts.get("valid_disconnected", 0) > 0,
    }
    store = {"memory": args.prefix_memory, "hits": int(metrics["h2okv_prefix_cache_hits_total"]),
             "misses": int(metrics["h2okv_prefix_cache_misses_total"]),
             "evictions": int(metrics["h2okv_prefix_cache_evictions_total"]),
             "bytes_end": int(metrics["h2okv_prefix_cache_bytes"]), "entries_end": int(metrics["h2okv_prefix_cache_entries"])}
    if args.prefix_memory:  # the store was used, filled and gave way, and kept to its budget
        checks["prefix_store_hits_and_evicts"] = store["hits"] > 0 and store["evictions"] > 0
        checks["prefix_store_within_budget"] = 0 < store["bytes_end"] <= args.prefix_memory
        if args.conversing:
            checks["conversations_resumed"] = counts.get("conversation_turns_resumed", 0) > 0
    return {
        "config": {"duration_s": args.duration, "clients": args.clients, "kv_memory": args.kv_memory,
                   "prefix_cache_memory": args.prefix_memory, "conversing": args.conversing,
                   "model": args.model or "tiny random (2 layers)", "seed": args.seed,
                   "max_rss_slope_mib_per_min": args.max_rss_slope},
        "elapsed_s": round(elapsed, 1),
        "counts": counts,
        "bad_requests": bad,
        "failures": tally.failures,
        "rss_first_minute_mib": None if first is None else round(first / 2**20, 1),
        "rss_last_minute_mib": None if last is None else round(last / 2**20, 1),
        "rss_slope_window_s": round(window, 1),
        "rss_slope_mib_per_min": None if slope is None else round(slope, 3),
        "rss_every_30s_mib": [round(rss / 2**20, 1) for t, rss in rss if int(t) % 30 == 0],
        "generated_tokens": int(metrics["h2okv_generated_tokens_total"]),
        "evicted_tokens": int(metrics["h2okv_evicted_tokens_total"]),
        "kv_bytes_in_use_end": int(metrics["h2okv_kv_bytes_in_use"]),
        "batch_size_max": int(metrics["h2okv_batch_size_max"]),
        "prefix_cache": store,
        "exit_code": exit_code,
        "checks": checks,
        "passed": all(checks.values()),
    }


def store_size(text: str) -> int:
    """A byte size for --prefix-cache-memory, or 0 (off)."""
    return 0 if str(text).strip() == "0" else parse_bytes(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2okv.tools.soak", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: 600)")
    p.add_argument("--clients", type=int, default=64, help="concurrent client loops (default: 64)")
    p.add_argument("--kv-memory", default="4M", help="the server's --kv-memory (default: 4M)")
    p.add_argument("--prefix-cache-memory", dest="prefix_memory", type=store_size, default="1M", metavar="SIZE",
                   help="the server's --prefix-cache-memory; 0: the store off (default: 1M, small enough that "
                        "the store fills and evicts)")
    p.add_argument("--conversing", type=float, default=0.25,
                   help="share of the clients that hold multi-turn conversations (default: 0.25)")
    p.add_argument("--model", default=None, help="checkpoint to serve (default: a tiny random model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-window", type=float, default=480.0,
                   help="seconds at the end of the load over which the RSS slope is fitted, at most 80%% of "
                        "--duration (default: 480)")
    p.add_argument("--max-rss-slope", type=float, default=1.0,
                   help="largest RSS slope over that window that passes, in MiB per minute (default: 1)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.clients <= 0:
        p.exit(2, "h2okv: error: --duration and --clients must be > 0\n")
    if not 0 <= args.conversing <= 1:
        p.exit(2, "h2okv: error: --conversing must be in [0, 1]\n")
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
