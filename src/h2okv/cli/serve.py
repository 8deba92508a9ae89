"""``h2okv serve`` (OpenAI-compatible server) and ``h2okv serve-bench`` (the same server under load,
one run per policy at the same KV memory)."""

from __future__ import annotations

import logging
import os
import sys

from h2okv.cli.args import (
    add_budget_args,
    add_cache_args,
    add_model_args,
    add_tp_args,
    budget_from_args,
    check_policy,
    examples,
    memory_limit,
    non_negative_float,
    parse_bytes,
    positive_float,
    positive_int,
    probability,
    store_size,
)
from h2okv.errors import H2OError
from h2okv.settings import CODING_FIELDS

API_KEY_ENV = "H2OKV_API_KEY"


def _add_max_batch(p, default: int) -> None:
    p.add_argument("--max-batch", type=positive_int, default=default,
                   help=f"most requests running at once (default: {default})")


def _add_schedule(p) -> None:
    p.add_argument("--schedule", choices=["budget", "serial"], default="budget",
                   help="prefill scheduling: 'budget' prefills one chunk of several prompts per forward, in one "
                        "shared forward, oldest first, up to --step-tokens tokens per step (pads included); 'serial' "
                        "runs one chunk of the oldest prompt per step, alone (the original behaviour) "
                        "(default: budget)")
    p.add_argument("--step-tokens", type=positive_int, default=512,
                   help="prompt tokens (pads included) one engine step may prefill with --schedule budget: the "
                        "most a decoding request waits between two tokens, in prefill work (default: 512)")


SERVE_EXAMPLES = examples(
    "h2okv serve --budget 0.2 --kv-memory 2G --port 8000",
    "h2okv serve --recipe document --kv-memory 2G --prefix-cache-memory 0",
)
SERVE_BENCH_EXAMPLES = examples(
    "h2okv serve-bench --profile decode-heavy --policies full,h2o --json serve-bench.json",
)


# What `h2okv serve` runs when neither --recipe nor --policy is given. The paper's plain h2o (the
# library's default) ranks a chat's document before its question exists and lost every hidden
# number of a served document chat (0.5B, 20%: 0/12, full 12/12); `bounded` ranks it with the
# question in view at the same memory (budget + one chunk): 9/12 (tools/measure/chat_store.py), and
# on CoQA chats (seed 1, 18 answers) 84% of full's score where `document` kept 37%.
DEFAULT_RECIPE = "bounded"
# the prefix store is on unless set to 0: without it every turn of a chat reads its whole history
# again (CoQA chats, 0.5B: later turns' TTFT 0.8 s resumed vs 24-29 s re-read)
DEFAULT_PREFIX_MEMORY = 512 << 20


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and H2O eviction",
                       epilog=SERVE_EXAMPLES)
    add_model_args(p)
    add_budget_args(p, policy_default=f"the {DEFAULT_RECIPE} recipe's", reconstruction=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model or smollm2)")
    p.add_argument("--kv-memory", type=memory_limit, default=None,
                   help="KV-cache bytes for all running requests, e.g. 512M or 2G (binary units; default: no limit)")
    p.add_argument("--prefix-cache-memory", type=store_size, default=DEFAULT_PREFIX_MEMORY, metavar="SIZE",
                   help="bytes for finished requests' compressed caches, resumed by a later prompt that starts "
                        "with the same tokens (a conversation's next turn): it then reads only the rest; least "
                        "recently used first out; apart from --kv-memory (default: 512M; 0 or off: none)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait; more get HTTP 429")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level (default: info)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        f"{API_KEY_ENV} environment variable; neither: no key)")
    p.add_argument("--request-timeout", type=positive_float, default=None,
                   help="seconds a request may take from arrival; then it ends with finish_reason 'timeout' "
                        "and the text so far (default: none)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longer prompts get HTTP 400 (default: the model's context length - 1; with "
                        "--positions rolling it may exceed the context: such prompts are read with eviction)")
    p.add_argument("--drain-timeout", type=positive_float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are ended (default: 30)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="temperature of requests that give none (default: the model's generation config; "
                   "the embedded smollm2: 0, greedy; qwen2.5-*: 0.7; else OpenAI's 1)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="top_p of requests that give none (default: as --temperature's; qwen2.5-*: 0.8)")
    p.add_argument("--max-n", type=positive_int, default=8,
                   help="most choices (n) one request may ask for; each is a running sequence of --max-batch, "
                        "so this caps the share of the batch one request takes; larger n gets HTTP 400 "
                        "(default: 8, at most --max-batch)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default="4M",
                   help="largest request body, e.g. 4M; a larger one gets HTTP 413 before it is read "
                        "(default: 4M, a 128k-token prompt with room to spare)")
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request body may take to arrive; then HTTP 408 (default: 30)")
    # the server's positions are its own flag's, whatever the recipe
    add_cache_args(p, ["prefill", "positions", *CODING_FIELDS], positions={
        "default": "true", "help": "true (default) or rolling (rolling:shift, rolling:order): evicting requests keep "
                                   "their positions inside the context window, so max_tokens may exceed the context "
                                   "length"})
    _add_max_batch(p, 32)
    _add_schedule(p)
    add_tp_args(p)
    # a prefill chunk runs between two decode steps of everyone else: keep it short
    chunk = next(a for a in p._actions if a.dest == "chunk_size")
    chunk.default, chunk.help = 128, "prefill chunk length: one chunk per engine step (default: 128)"
    p.set_defaults(func=run_serve)

    b = sub.add_parser("serve-bench", help="throughput and latency of `serve` per policy at the same KV memory",
                       epilog=SERVE_BENCH_EXAMPLES)
    add_model_args(b)
    b.add_argument("--profile", choices=["prefill-heavy", "decode-heavy", "gsm8k", "chat"], default="prefill-heavy",
                   help="workload whose settings fill the options not given: prefill-heavy (16 requests, "
                        "256-token prompts, 64 new tokens, 30M), decode-heavy (32 requests, 128-token prompts, "
                        "1024 new tokens, heavy 64 + recent 64, 256M) or gsm8k (32 real GSM8K problems as 0-shot "
                        "chat prompts, up to 512 new tokens until EOS, heavy 64 + recent 64, 64M; the served "
                        "answers are graded) or chat (4 conversations of 3 turns over ~1,024-token essays, each "
                        "policy with a 256M prefix store and without, graded) (default: prefill-heavy)")
    b.add_argument("--plot", default=None, metavar="PNG",
                   help="--profile chat: time to first token per turn, each run a line (default: none)")
    b.add_argument("--turns", type=positive_int, default=None, help="turns per conversation (--profile chat; default 3)")
    b.add_argument("--prefix-cache-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="the prefix store of the runs with one (--profile chat; default 256M)")
    b.add_argument("--kv-memory", type=parse_bytes, default=None,
                   help="KV-cache bytes shared by running requests, e.g. 64M (binary units; default: the profile's)")
    b.add_argument("--policies", default="full,h2o", help="comma-separated policies to compare (default: full,h2o)")
    b.add_argument("--recipe", default=None, metavar="NAME,...",
                   help="comma-separated recipes run beside --policies, each as `serve --recipe NAME` would, with "
                        "the total of the budget given split its own way (e.g. document; see `serve --help`)")
    b.add_argument("--heavy", type=int, default=None, help="heavy-hitter slots (evicting policies)")
    b.add_argument("--recent", type=int, default=None, help="recent slots (evicting policies)")
    b.add_argument("--heavy-ratio", type=float, default=None, help="heavy slots as a fraction of the prompt")
    b.add_argument("--recent-ratio", type=float, default=None, help="recent slots as a fraction of the prompt")
    b.add_argument("--chunk-size", type=positive_int, default=128, help="prefill chunk length: one chunk per engine step (default: 128)")
    b.add_argument("--requests", type=positive_int, default=None, help="requests sent (default: the profile's)")
    b.add_argument("--concurrency", type=positive_int, default=None, help="clients in flight at once")
    b.add_argument("--prompt-tokens", type=positive_int, default=None, help="tokens per prompt (default: the profile's)")
    b.add_argument("--max-tokens", type=positive_int, default=None, help="new tokens per request (default: the profile's)")
    b.add_argument("--json", default=None, help="write the results here")
    b.add_argument("--schedules", default="budget",
                   help="comma-separated prefill schedules to run for every policy: budget, serial (default: budget)")
    b.add_argument("--step-tokens", type=positive_int, default=512,
                   help="prompt tokens per engine step with the budget schedule (default: 512)")
    b.add_argument("--arrival-rate", type=positive_float, default=None,
                   help="Poisson arrivals at this many requests/s (default: all at once, --concurrency in flight)")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: 0)")
    _add_max_batch(b, 64)
    add_cache_args(b, list(CODING_FIELDS))  # every server's caches quantized, full's too
    b.set_defaults(func=run_bench)


def run_serve(args) -> int:
    from h2okv.core.positions import check_positions
    from h2okv.parallel import launch
    from h2okv.policies import policy_class
    from h2okv.serve.eviction import EvictionDefaults

    if args.policy is not None:
        check_policy(args.policy, reconstruction=True)
    # no --recipe and no --policy: the default recipe (a chat's question ranks its document)
    recipe = DEFAULT_RECIPE if args.recipe is None and args.policy is None else args.recipe
    # one CacheSettings, checked as it is built: before the (slow) model load
    eviction = EvictionDefaults.from_options(recipe=recipe, policy=args.policy, prefill=args.prefill,
                                             budget=args.budget, bytes=args.bytes, recent_share=args.recent_share,
                                             budget_floor=args.budget_floor, kv_bits=args.kv_bits,
                                             kv_group=args.kv_group, key_bits=args.key_bits,
                                             float_window=args.float_window, center_keys=args.center_keys,
                                             **budget_from_args(args))
    check_positions(policy_class(eviction.policy), args.positions)
    if args.max_queue < 0:
        raise H2OError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise H2OError(f"--port must be in 1..65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise H2OError(f"--api-key / {API_KEY_ENV} must not be empty")
    args.eviction, args.kv_memory_bytes, args.api_key = eviction, args.kv_memory, api_key
    if args.temperature is not None and args.temperature > 2:
        raise H2OError(f"--temperature must be at most 2 (as a request's), got {args.temperature:g}")
    launch.prepare(args)  # --tp: the model must shard (a config read, before any rank starts)
    return launch.run(args, serve_on_rank, signals_to_rank0=True)


def serve_on_rank(args) -> int:
    """The server in this process, or one rank of ``serve --tp N``: rank 0 serves HTTP and drives
    the others, which run its executor calls (``serve/tp.py``)."""
    from h2okv.models import DEFAULT_MODEL, load_model
    from h2okv.parallel.ranks import is_distributed, is_main_rank
    from h2okv.serve import serve_forever
    from h2okv.serve.api.sampling_defaults import SamplingDefaults
    from h2okv.serve.executor import Executor
    from h2okv.serve.heap import pin_mmap_threshold

    pin_mmap_threshold()  # a long-running process: freed large buffers go back to the OS (serve/heap.py)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp)
    args.eviction = args.eviction.for_model(model.config)  # a budget in bytes: this model's slots
    args.sampling = SamplingDefaults.resolve(args.model or DEFAULT_MODEL, model.generation_config,
                                             args.temperature, args.top_p)
    if is_main_rank():
        s = args.sampling
        print(serving_line(args.eviction, args.kv_memory_bytes, args.prefix_cache_memory), file=sys.stderr, flush=True)
        print(f"h2okv: requests that give no temperature / top_p sample at {s.temperature:g} / {s.top_p:g} "
              f"({s.source}; --temperature, --top-p set them)", file=sys.stderr, flush=True)
    if not is_distributed():
        app = _create_app(args, model, tokenizer, None)
        serve_forever(app, host=args.host, port=args.port, log_level=args.log_level, drain_timeout=args.drain_timeout)
        return 0

    from h2okv.serve import tp

    channel = tp.Channel(heartbeat_s=tp.heartbeat_seconds(args.tp_timeout))
    executor = Executor(model, args.chunk_size, args.eviction.prefill, args.positions, args.eviction.cache_options())
    if not is_main_rank():
        tp.follow(executor, channel, tp.RankFigures(executor, channel.rank))
        return 0
    leader = tp.Leader(executor, channel)
    try:
        channel.start_heartbeat()
        app = _create_app(args, model, tokenizer, leader)
        app.state.metrics.registry.register(tp.RankCollector(leader))

        def stop_when_broken(server) -> None:
            def stop() -> None:
                # the one line the launcher prints says why; the requests failing on the way out
                # would only repeat it, traceback by traceback
                logging.getLogger("h2okv.serve").setLevel(logging.CRITICAL)
                server.should_exit = True

            channel.on_broken(stop)

        serve_forever(app, host=args.host, port=args.port, log_level=args.log_level,
                      drain_timeout=args.drain_timeout, on_server=stop_when_broken)
    finally:
        channel.close()  # the followers leave their loops: every rank exits
    if channel.broken is not None:
        cause = channel.broken
        raise tp.GroupBroken(f"the tensor-parallel group broke: {type(cause).__name__}: {cause}") from cause
    return 0


def serving_line(eviction, kv_memory: int | None, prefix_memory: int) -> str:
    """One line at startup: what requests that name no recipe or policy run, and the memory caps
    (a user who ran `h2okv serve` with no flags sees what they got, and which flags change it)."""
    settings = eviction.describe()
    what = f"the {settings['recipe']} recipe ({settings['policy']})" if settings.get("recipe") else settings["policy"]
    budget = settings.get("budget")
    kept = "" if budget is None else f" at {budget:g} slots" if isinstance(budget, int) else f" at {budget:.0%}"
    kv = "no limit" if kv_memory is None else f"{kv_memory / 2**20:.0f} MiB"
    store = "off" if not prefix_memory else f"{prefix_memory / 2**20:.0f} MiB"
    return (f"h2okv: requests run {what}{kept}, {eviction.prefill} prefill; KV memory {kv}, prefix store {store} "
            "(--recipe/--policy/--budget, --kv-memory, --prefix-cache-memory change them)")


def _create_app(args, model, tokenizer, executor):
    from h2okv.serve import create_app
    from h2okv.serve.api.limits import ServerLimits
    from h2okv.serve.engine import EngineOptions

    options = EngineOptions(kv_memory=args.kv_memory_bytes, max_batch=args.max_batch, max_queue=args.max_queue,
                            prefill_chunk=args.chunk_size, schedule=args.schedule, step_tokens=args.step_tokens,
                            positions=args.positions, prefix_memory=args.prefix_cache_memory)
    limits = ServerLimits(max_prompt_tokens=args.max_prompt_tokens, request_timeout=args.request_timeout,
                          max_n=args.max_n, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout)
    return create_app(model, tokenizer, model_name=args.served_model_name or args.model or "smollm2",
                      eviction=args.eviction, options=options, limits=limits, api_key=args.api_key,
                      executor=executor, sampling=args.sampling)


def run_bench(args) -> int:
    from h2okv.bench.serve import run

    if args.profile == "chat":
        from h2okv.bench.chat import run_chat

        return run(args, run_chat)
    return run(args)
