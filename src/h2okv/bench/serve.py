"""``h2okv serve-bench``: load generation against an OpenAI-compatible server.

``drive`` sends streaming completions from concurrent clients and checks every stream is well formed
(each event is ``data: <json>``, a ``finish_reason`` arrives, the usage chunk agrees with the text
chunks, ``[DONE]`` ends it). ``bench`` serves the same model in-process once per policy at the same
``--kv-memory`` and drives each with the same prompts, so the only difference is how much KV memory a
request holds, hence how many run at once. ``--schedules budget,serial`` repeats every policy under
both prefill schedules; ``--arrival-rate`` sends requests at Poisson arrival times instead of all at
once.

Three profiles (``--profile``): ``prefill-heavy`` (long prompts, few new tokens: questions or
summaries over a document), ``decode-heavy`` (short prompts, long generations: the paper's dialogue and
story-writing setting, where the KV cache grows with every generated token) and ``gsm8k`` (real
GSM8K problems as 0-shot chat prompts, greedy until EOS, each served answer graded like
``h2okv eval reasoning`` grades it: throughput comes with the accuracy it was served at).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from h2okv.errors import H2OError
from h2okv.eval.output import write_json
from h2okv.settings import CODING_FIELDS, DEFAULT_KV_GROUP, coding_label, slot_coding_keywords


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    events: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive text chunks (inter-token latency)
    usage: dict | None = None  # the final usage chunk (prompt_tokens_details.cached_tokens: read from the store)


@dataclass
class LoadReport:
    results: list[RequestResult]
    wall_s: float
    summary: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """One streaming ``/v1/completions`` call, validated event by event."""
    start = time.perf_counter()
    result = RequestResult(ok=False, latency_s=0.0)
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    texts, usage, done = [], None, False
    last_text_at = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {detail[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line:
                    continue
                if done:
                    raise ValueError(f"data after [DONE]: {line[:80]!r}")
                if not line.startswith("data: "):
                    raise ValueError(f"not an SSE data line: {line[:80]!r}")
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                result.events += 1
                if "error" in event:
                    raise ValueError(f"error event: {event['error'].get('message')}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - start
                        else:
                            result.gaps_s.append(now - last_text_at)
                        last_text_at = now
                        texts.append(choice["text"])
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
        if not done:
            raise ValueError("stream ended without [DONE]")
        if result.finish_reason is None:
            raise ValueError("no finish_reason in the stream")
        if usage is None:
            raise ValueError("no usage chunk despite stream_options.include_usage")
        result.completion_tokens = usage["completion_tokens"]
        result.usage = usage
        result.text = "".join(texts)
        result.ok = True
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency_s = time.perf_counter() - start
    return result


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Start times (seconds from 0) of ``count`` requests arriving as a Poisson process of ``rate``/s."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def drive(base_url: str, payloads: list[dict], concurrency: int, timeout: float = 3600.0,
                arrivals: list[float] | None = None) -> LoadReport:
    """Send ``payloads`` as streaming completions, at most ``concurrency`` in flight; with
    ``arrivals``, request ``i`` is sent no earlier than ``arrivals[i]`` seconds after the start (its
    latencies count from then)."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one(i, payload):
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with limit:
                return await stream_completion(client, base_url, payload)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)))
        wall = time.perf_counter() - start
    return LoadReport(list(results), wall, summarize(list(results), wall))


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    latencies = [r.latency_s for r in ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s else None,
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s else None,
        "completion_tokens": tokens,
        "latency_p50_s": _round(percentile(latencies, 0.5)),
        "latency_p95_s": _round(percentile(latencies, 0.95)),
        "ttft_p50_s": _round(percentile(ttfts, 0.5)),
        "ttft_p95_s": _round(percentile(ttfts, 0.95)),
        "itl_p50_s": _round(percentile(gaps, 0.5), 4),
        "itl_p95_s": _round(percentile(gaps, 0.95), 4),
    }


def _round(value, digits: int = 3):
    return None if value is None else round(value, digits)


def scrape(base_url: str) -> dict[str, float]:
    """Unlabelled samples of ``/metrics`` by name (counters carry their ``_total`` suffix)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                samples[sample.name] = sample.value
    return samples


def hamlet_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` different prompts of exactly ``tokens`` token ids, cut from Hamlet at spread offsets."""
    from h2okv.corpus import read_play

    ids = tokenizer(read_play("hamlet_gut"), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens + 1:
        raise H2OError(f"--prompt-tokens {tokens} is longer than the corpus ({len(ids)} tokens)")
    span = len(ids) - tokens
    return [ids[(i * 7919) % span:(i * 7919) % span + tokens] for i in range(count)]


def reasoning_payloads(tokenizer, task: str, count: int, max_tokens: int, model_name: str):
    """``(payloads, problems)``: the first ``count`` problems of ``task`` as ``eval reasoning``'s 0-shot
    chat prompts (token ids), greedy, ending at EOS."""
    from h2okv.eval.reasoning import prompt_ids
    from h2okv.eval.reasoning_data import load_problems

    problems = load_problems(task, count)
    payloads = [{"model": model_name, "prompt": prompt_ids(tokenizer, p, "chat"), "max_tokens": max_tokens,
                 "temperature": 0.0} for p in problems]
    return payloads, problems


def grade(results: list[RequestResult], problems) -> dict:
    """Accuracy of the served answers (a failed request counts as wrong), graded as ``eval reasoning`` does."""
    from lm_eval.api.metrics import mean_stderr

    from h2okv.eval.answers import extract_answer, is_correct

    scores = [float(r.ok and is_correct(p.task, extract_answer(p.task, r.text), p.gold))
              for r, p in zip(results, problems, strict=True)]
    return {"accuracy": round(sum(scores) / len(scores), 4),
            "accuracy_stderr": round(mean_stderr(scores), 4) if len(scores) > 1 else None,
            "correct": int(sum(scores)), "graded": len(scores)}


def server_settings(policies: list[str], recipes: list[str], budget: dict | None,
                    coding: dict | None = None) -> list[tuple[str, object]]:
    """``(label, EvictionDefaults)`` of every server a bench starts: each policy with ``budget``
    (``heavy``/``recent``/ratios; none for a policy that keeps everything), then each recipe as
    ``serve --recipe`` builds it, given the same total budget, which it splits its own way.
    ``coding``: quantized slots (``serve --kv-bits``) for every server, its label saying so."""
    from h2okv.policies import make_policy
    from h2okv.serve.eviction import EvictionDefaults

    budget, coding = budget or {}, coding or {}
    label = coding_label(coding.get("kv_bits"), coding.get("key_bits"), coding.get("kv_group", DEFAULT_KV_GROUP),
                         coding.get("float_window", 0), coding.get("center_keys", False))
    suffix = f" {label}" if label else ""
    out = [(policy + suffix, EvictionDefaults.from_options(policy=policy, budget_floor=0, **coding,
                                                           **(budget if make_policy(policy).evicts else {})))
           for policy in policies]
    total = None
    if "heavy" in budget or "recent" in budget:
        total = int(budget.get("heavy", 0)) + int(budget.get("recent", 0))
    elif "heavy_ratio" in budget or "recent_ratio" in budget:
        total = float(budget.get("heavy_ratio", 0.0)) + float(budget.get("recent_ratio", 0.0))
    for recipe in recipes:
        out.append((recipe + suffix, EvictionDefaults.from_options(recipe=recipe, budget_floor=0, budget=total,
                                                                   **coding)))
    return out


@dataclass(frozen=True)
class ServeBenchOptions:
    """One ``serve-bench`` run: the servers it starts (every schedule x every policy, then recipe, at
    the same ``kv_memory``) and the load it drives at each (``serve-bench``'s flags of the same names;
    ``--chunk-size`` is ``prefill_chunk``)."""

    policies: tuple[str, ...]
    kv_memory: int  # bytes, every server's
    requests: int
    concurrency: int
    max_tokens: int
    prompt_tokens: int | None = None  # Hamlet cuts of this many tokens; None with a ``task``
    budget: dict | None = None  # heavy/recent/ratios, for the evicting policies (a recipe splits the total)
    recipes: tuple[str, ...] = ()
    prefill_chunk: int = 128
    max_batch: int = 64
    schedules: tuple[str, ...] = ("budget",)
    step_tokens: int = 512
    arrival_rate: float | None = None  # requests per second, Poisson; None: all at once
    seed: int = 0
    task: str | None = None  # served reasoning problems (e.g. gsm8k), graded, instead of Hamlet cuts
    model_name: str = "bench"
    coding: dict | None = None  # quantized slots for every server (settings.slot_coding_keywords)


def bench(model, tokenizer, options: ServeBenchOptions, progress=print) -> dict:
    """Serve ``model`` once per (schedule, policy) at the same ``kv_memory``; drive each with the same
    prompts (and arrival times): Hamlet cuts of ``prompt_tokens`` generating ``max_tokens`` each, or,
    with ``task``, that task's problems, graded."""
    from h2okv.serve.api.app import create_app
    from h2okv.serve.api.server import running_server
    from h2okv.serve.engine import EngineOptions

    o = options
    problems = None
    if o.task:
        payloads, problems = reasoning_payloads(tokenizer, o.task, o.requests, o.max_tokens, o.model_name)
    else:
        payloads = [{"model": o.model_name, "prompt": p, "max_tokens": o.max_tokens, "temperature": 0.0,
                     "ignore_eos": True} for p in hamlet_prompts(tokenizer, o.requests, o.prompt_tokens)]
    arrivals = None if o.arrival_rate is None else poisson_arrivals(o.requests, o.arrival_rate, o.seed)
    rows = []
    for schedule in o.schedules:
        for policy, eviction in server_settings(list(o.policies), list(o.recipes), o.budget, o.coding):
            engine_options = EngineOptions(kv_memory=o.kv_memory, max_batch=o.max_batch,
                                           max_queue=max(256, o.requests), prefill_chunk=o.prefill_chunk,
                                           schedule=schedule, step_tokens=o.step_tokens)
            app = create_app(model, tokenizer, model_name=o.model_name, eviction=eviction, options=engine_options)
            engine = app.state.engine
            load_before = os.getloadavg()[0]
            with running_server(app) as url:
                report = asyncio.run(drive(url, payloads, o.concurrency, arrivals=arrivals))
                after = scrape(url)
            probe = engine.reservation(_probe_request(payloads[0], eviction, engine))
            queued = list(engine.queue_times)
            steps = engine.stats.steps.summary()
            row = {
                "policy": policy,
                "schedule": schedule,
                **report.summary,
                "queue_p50_s": _round(percentile(queued, 0.5)),
                "queue_p95_s": _round(percentile(queued, 0.95)),
                "max_concurrent_batch": int(after["h2okv_batch_size_max"]),
                "kv_slots_per_request": probe.slots,
                "kv_bytes_per_request": probe.slots * engine.slot_bytes,
                "kv_bytes_peak": int(after["h2okv_kv_bytes_peak"]),
                "kv_bytes_in_use_after": int(after["h2okv_kv_bytes_in_use"]),
                "evicted_tokens": int(after["h2okv_evicted_tokens_total"]),
                # the engine's steps: the share of their time outside the model's forward, and that time per step
                "engine_steps": steps["steps"],
                "outside_forward_share": steps["outside_share"],
                **{f"outside_forward_ms_{stat}": steps[f"outside_ms_{stat}"] for stat in ("mean", "p50", "p99")},
                # the machine may be shared: 1-minute load averages around the run, for context
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                **(grade(report.results, problems) if problems else {}),
            }
            rows.append(row)
            progress(format_row(row))
    return {
        "config": {"kv_memory": o.kv_memory, "requests": o.requests, "concurrency": o.concurrency,
                   "prompt_tokens": o.prompt_tokens, "max_tokens": o.max_tokens, "budget": o.budget or {},
                   "prefill_chunk": o.prefill_chunk, "max_batch": o.max_batch, "schedules": list(o.schedules),
                   "step_tokens": o.step_tokens, "arrival_rate": o.arrival_rate, "seed": o.seed, "task": o.task,
                   "coding": o.coding or {},
                   "bytes_per_token": app.state.engine.slot_bytes, "device": str(model.device),
                   "dtype": str(model.dtype).removeprefix("torch."),
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "results": rows,
        "summary": ratios(rows),
    }


def ratios(rows: list[dict]) -> dict:
    """The comparisons the targets are stated in, from rows of the same run: each evicting policy
    against full per schedule (``{schedule}/{policy}_vs_full_tokens_per_s``; the first schedule's
    also as the top-level ``{policy}_vs_full_tokens_per_s``), and per policy the serial schedule's
    TTFT p95 over the budget schedule's."""
    by = {(r["schedule"], r["policy"]): r for r in rows}
    out: dict = {}
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        full = by.get((schedule, "full"))
        for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
            evicting = by.get((schedule, policy))
            if not (evicting and full and full["tokens_per_s"] and evicting["tokens_per_s"]):
                continue
            tokens = round(evicting["tokens_per_s"] / full["tokens_per_s"], 3)
            out.setdefault(f"{policy}_vs_full_tokens_per_s", tokens)
            out[f"{schedule}/{policy}_vs_full_tokens_per_s"] = tokens
            if evicting["itl_p95_s"] and full["itl_p95_s"]:
                out[f"{schedule}/full_vs_{policy}_itl_p95"] = round(full["itl_p95_s"] / evicting["itl_p95_s"], 3)
            if full.get("accuracy_stderr"):  # served answers graded: the accuracy gap in full's standard errors
                gap = (evicting["accuracy"] - full["accuracy"]) / full["accuracy_stderr"]
                out[f"{schedule}/{policy}_minus_full_accuracy_in_stderr"] = round(gap, 3)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        serial, budget = by.get(("serial", policy)), by.get(("budget", policy))
        if serial and budget and serial["ttft_p95_s"] and budget["ttft_p95_s"]:
            out[f"{policy}/ttft_p95_serial_over_budget"] = round(serial["ttft_p95_s"] / budget["ttft_p95_s"], 3)
    return out


def _probe_request(payload, eviction, engine):
    from h2okv.serve.types import GenerationRequest

    policy, heavy, recent = eviction.resolve(len(payload["prompt"]))
    return GenerationRequest(prompt_ids=payload["prompt"], max_tokens=payload["max_tokens"], policy=policy,
                             heavy=heavy, recent=recent)


def format_row(row: dict) -> str:
    graded = f", accuracy {row['correct']}/{row['graded']}" if "graded" in row else ""
    if row["outside_forward_share"] is None:  # no step ran (every request refused): say so, not crash
        return f"{row['policy']:>6} ({row['schedule']}): {row['ok']}/{row['requests']} ok, no engine step ran"
    return (f"{row['policy']:>6} ({row['schedule']}): {row['ok']}/{row['requests']} ok{graded}, {row['requests_per_s']} req/s, "
            f"{row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_p50_s']} s p95 {row['ttft_p95_s']} s, "
            f"ITL p50 {row['itl_p50_s']} s p95 {row['itl_p95_s']} s, queue p95 {row['queue_p95_s']} s, "
            f"max batch {row['max_concurrent_batch']}, KV/request {row['kv_bytes_per_request'] / 2**20:.2f} MiB, "
            f"peak KV {row['kv_bytes_peak'] / 2**20:.2f} MiB, outside the forward {row['outside_forward_share']:.1%} "
            f"of step time ({row['outside_forward_ms_p50']} ms a step, p50)")


def bench_command(args) -> str:
    """The command line that reproduces this run (from the parsed arguments, not ``sys.argv``)."""
    parts = ["h2okv serve-bench", f"--profile {args.profile}", f"--kv-memory {args.kv_memory}",
             f"--policies {args.policies}", *([f"--recipe {args.recipe}"] if getattr(args, "recipe", None) else []),
             f"--schedules {args.schedules}",
             f"--requests {args.requests}", f"--concurrency {args.concurrency}",
             *([f"--prompt-tokens {args.prompt_tokens}"] if args.prompt_tokens else []), f"--max-tokens {args.max_tokens}",
             f"--chunk-size {args.chunk_size}", f"--step-tokens {args.step_tokens}", f"--max-batch {args.max_batch}"]
    for name in ("heavy", "recent", "heavy_ratio", "recent_ratio", "arrival_rate", "model", "device", "dtype",
                 *CODING_FIELDS, "json"):
        if getattr(args, name, None) is not None:
            parts.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return " ".join(parts)


# what --profile fills in for the options not given on the command line
PROFILES = {
    # long prompts, short answers: 256-token prompts, 64 new tokens; budget 10% + 10% of the prompt
    "prefill-heavy": {"kv_memory": 30 << 20, "requests": 16, "concurrency": 16, "prompt_tokens": 256, "max_tokens": 64},
    # long generations from short prompts (the paper's dialogue and story writing), a fixed 64 + 64 budget
    "decode-heavy": {"kv_memory": 256 << 20, "requests": 32, "concurrency": 32, "prompt_tokens": 128,
                     "max_tokens": 1024, "heavy": 64, "recent": 64},
    # served reasoning: real GSM8K problems (0-shot chat, ~70-150 prompt tokens), up to 512 new
    # tokens until EOS, graded; a fixed 64 + 64 budget (eval reasoning's 128-slot point)
    "gsm8k": {"kv_memory": 64 << 20, "requests": 32, "concurrency": 32, "max_tokens": 512, "heavy": 64, "recent": 64,
              "task": "gsm8k"},
    # conversations over long documents (bench/chat.py): 4 of 3 turns over ~1,024-token essays, 16 new
    # tokens a turn, 20% of each prompt; every policy with a 256 MiB prefix store and without
    "chat": {"kv_memory": 256 << 20, "requests": 4, "concurrency": 4, "prompt_tokens": 1024, "max_tokens": 16,
             "heavy_ratio": 0.1, "recent_ratio": 0.1, "turns": 3, "prefix_cache_memory": 256 << 20},
}


def apply_profile(args) -> None:
    """Fill the options left unset (None) from ``args.profile``; explicit options win (any budget
    option given replaces the profile's whole budget)."""
    budget_given = any(getattr(args, k, None) is not None for k in ("heavy", "recent", "heavy_ratio", "recent_ratio"))
    for name, value in PROFILES[args.profile].items():
        if name in ("heavy", "recent", "heavy_ratio", "recent_ratio") and budget_given:
            continue
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def run(args, run_chat=None) -> int:
    """``h2okv serve-bench``: load the model, bench each policy, print and write JSON (``run_chat``:
    what runs ``--profile chat``, ``bench.chat.run_chat``)."""
    from h2okv.models import load_model
    from h2okv.recipes import parse_recipes
    from h2okv.serve.scheduler import SCHEDULES

    apply_profile(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise H2OError("--policies needs at least one policy")
    schedules = tuple(dict.fromkeys(s.strip() for s in args.schedules.split(",") if s.strip()))
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise H2OError(f"--schedules takes a comma-separated list of {', '.join(SCHEDULES)}, got {args.schedules!r}")
    budget = {k: getattr(args, k) for k in ("heavy", "recent", "heavy_ratio", "recent_ratio")
              if getattr(args, k, None) is not None}
    recipes = parse_recipes(args.recipe) if getattr(args, "recipe", None) else []
    coding = slot_coding_keywords(getattr(args, "kv_bits", None), getattr(args, "kv_group", None) or DEFAULT_KV_GROUP,
                                  getattr(args, "key_bits", None), getattr(args, "float_window", None) or 0)
    server_settings(policies, recipes, budget, coding)  # each built, so checked, before the slow model load
    kv_memory = args.kv_memory  # bytes: the command line parsed them (h2okv.sizes.parse_bytes)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.profile == "chat":  # bench/chat.py, which the command line sends here with its loaded pieces
        return run_chat(args, model, tokenizer, policies, budget, recipes)
    options = ServeBenchOptions(
        policies=tuple(policies), kv_memory=kv_memory, requests=args.requests, concurrency=args.concurrency,
        max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, budget=budget, recipes=tuple(recipes),
        prefill_chunk=args.chunk_size, max_batch=args.max_batch, schedules=schedules, step_tokens=args.step_tokens,
        arrival_rate=args.arrival_rate, seed=args.seed, task=getattr(args, "task", None),
        model_name=args.model or "smollm2", coding=coding)
    result = bench(model, tokenizer, options)
    result["command"] = bench_command(args)
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    failed = [r for r in result["results"] if r["ok"] != r["requests"]]
    return 1 if failed else 0

