"""The engine's per-step time outside the model forward, on the tests' tiny model.

``--requests`` (64) requests of ``--max-tokens`` (1,000) new tokens each (``ignore_eos``, greedy,
prompts of ``--prompt-tokens`` cut from Hamlet; ``--policy h2o`` at 64 + 64 slots, or ``full``) are
submitted at once to one in-process ``Engine`` with room for all of them, run as the server runs it:
its ``ServeMetrics`` observer, every request's events sent to an asyncio event loop. The model is
``tests/serve/conftest.py``'s (``tiny_chat_model(layers=3, initializer_range=0.3)``): a decode
forward of 64 rows takes ~2 ms on one CPU thread, so whatever the engine itself costs a step shows.

The engine times each step and the executor's forward calls inside it (``EngineStats.steps``); the
rest is its own work: scheduling, sampling, stop checks, routing events, detokenizing what decides
a step (stop strings), and the executor's calls that move rows between caches (``join``,
``join_many``, ``keep``: timed here, reported beside). A plain request's text (these requests: no
stop strings) is decoded by its handle, on the thread that takes its events in. Printed and written
(``--json``) per run: the share of step time outside the forward and the time outside it per step
(mean, p50, p99, ms). ``--reader after`` (the default) reads the events once the run is over, so
the engine runs alone; the time that reading takes (decoding included) is reported beside
(``read_after_s``). ``during`` reads them on the loop's thread as they come, as the server does,
whose work (decoding included) then shares the GIL, and on one core the CPU, with the engine's.

``--before REF`` measures ``src/h2okv/serve`` as of the git commit ``REF`` too (the rest of the
tree as it is now), in turns with the current code, each run in a process of its own, so that
both see the same machine::

    .venv/bin/python tools/measure/engine_overhead.py --before <commit> --repeats 3 --json /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(args) -> dict:
    """One run in this process: the engine's step times for the whole load."""
    import asyncio
    import threading
    import time

    import torch

    from h2okv.bench.serve import hamlet_prompts
    from h2okv.serve.api.metrics import ServeMetrics
    from h2okv.serve.engine import Engine, EngineOptions
    from h2okv.serve.types import GenerationRequest
    from h2okv.tools.tiny_chat import tiny_chat_model

    torch.set_num_threads(args.threads)
    model, tok = tiny_chat_model(layers=3, initializer_range=0.3)
    engine = Engine(model, tok, EngineOptions(max_batch=args.requests, max_queue=args.requests))
    engine.observer = ServeMetrics(engine)
    evicting = args.policy != "full"
    requests = [GenerationRequest(ids, args.max_tokens, args.policy, heavy=args.heavy if evicting else None,
                                  recent=args.recent if evicting else None, temperature=0.0, ignore_eos=True)
                for ids in hamlet_prompts(tok, args.requests, args.prompt_tokens)]
    # the events go to an event loop, as the server's do (Handle.push_all); read as they come
    # (--reader during, the server's way) or once the run is over (after: the engine's own cost alone)
    loop = asyncio.new_event_loop()
    if args.reader == "during":
        threading.Thread(target=loop.run_forever, daemon=True).start()

    async def read(handle) -> int:
        events = 0
        while not (await handle.next()).final:
            events += 1
        return events

    async def read_all(handles) -> list[int]:
        return await asyncio.gather(*(read(h) for h in handles))

    cache_s = [0.0]

    def timed(call):
        def run(*call_args):
            start = time.perf_counter()
            try:
                return call(*call_args)
            finally:
                cache_s[0] += time.perf_counter() - start
        return run

    for name in ("join", "join_many", "keep"):  # executor calls outside the forward that copy cache rows
        if hasattr(engine.executor, name):  # (an older serve/ has no join_many)
            setattr(engine.executor, name, timed(getattr(engine.executor, name)))
    engine.start()
    try:
        start = time.perf_counter()
        handles = engine.submit_many(requests, loop)
        if args.reader == "during":
            events = asyncio.run_coroutine_threadsafe(read_all(handles), loop).result()
        else:  # no other thread runs Python meanwhile
            for handle in handles:
                handle.finished.wait()
        wall = time.perf_counter() - start
        read_after = None
        if args.reader == "after":
            start = time.perf_counter()
            events = loop.run_until_complete(read_all(handles))
            read_after = round(time.perf_counter() - start, 3)
    finally:
        engine.stop()
        if args.reader == "during":
            loop.call_soon_threadsafe(loop.stop)
    steps = engine.stats.steps.summary()
    return {"wall_s": round(wall, 3), "tokens": engine.stats.generated_tokens, "text_events": sum(events),
            "tokens_per_s": round(engine.stats.generated_tokens / wall, 1), **steps,
            "join_keep_s": round(cache_s[0], 4), "read_after_s": read_after}


def source_at(ref: str, into: Path) -> Path:
    """A copy of ``src`` whose ``h2okv/serve`` is the one committed at ``ref``."""
    src = into / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(src / "h2okv" / "serve")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/h2okv/serve"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return src


def run_child(src: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a run with {src} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def line(label: str, r: dict) -> str:
    return (f"{label:>7}: {r['outside_share']:.1%} of step time outside the forward; outside per step "
            f"mean {r['outside_ms_mean']:.3f} ms, p50 {r['outside_ms_p50']:.3f} ms, p99 {r['outside_ms_p99']:.3f} ms; "
            f"forward {r['forward_s']:.2f} s of {r['step_s']:.2f} s over {r['steps']} steps (executor join/keep "
            f"{r['join_keep_s']:.2f} s of the rest); "
            f"{r['tokens_per_s']:.0f} tokens/s"
            + ("" if r.get("read_after_s") is None else f"; events read after the run in {r['read_after_s']:.2f} s"))


MEASURED = ("requests", "max_tokens", "prompt_tokens", "policy", "heavy", "recent", "threads", "reader")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests, all in one batch (default 64)")
    parser.add_argument("--max-tokens", type=int, default=1000, help="new tokens per request (default 1000)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    parser.add_argument("--policy", default="h2o", help="h2o (default, at --heavy + --recent slots) or full")
    parser.add_argument("--heavy", type=int, default=64)
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--reader", choices=("after", "during"), default="after",
                        help="after (default): the events wait on the event loop until the run ends, so the engine "
                        "runs alone; during: the loop's thread reads them as they come, as the server's does (its "
                        "work then takes the GIL from the engine)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each code, in turns (default 1)")
    parser.add_argument("--before", default=None, metavar="REF", help="also measure src/h2okv/serve as of REF")
    parser.add_argument("--json", default=None, help="write the runs here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, one JSON line out
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    child = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in MEASURED]
    runs: dict[str, list[dict]] = {"before": [], "after": []} if args.before else {"after": []}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"after": ROOT / "src"}
        if args.before:
            sources["before"] = source_at(args.before, Path(tmp))
        for _ in range(args.repeats):
            for label in runs:
                runs[label].append(run_child(sources[label], child))
                print(line(label, runs[label][-1]), flush=True)
    summary = {label: {"outside_share_median": statistics.median(r["outside_share"] for r in rows),
                       "outside_ms_mean_median": statistics.median(r["outside_ms_mean"] for r in rows)}
               for label, rows in runs.items()}
    for label, s in summary.items():
        print(f"{label}: median {s['outside_share_median']:.1%} of step time outside the forward, "
              f"{s['outside_ms_mean_median']:.3f} ms a step")
    if args.json:
        result = {"config": {name: getattr(args, name) for name in (*MEASURED, "repeats", "before")},
                  "command": " ".join(["tools/measure/engine_overhead.py", *(argv or sys.argv[1:])]),
                  "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                  "runs": runs, "summary": summary}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
