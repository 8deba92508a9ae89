"""``h2okv demo`` (what ``make demo`` runs): in about a minute on the default model, why the choice
of what to evict matters.

1. Retrieval: passkeys hidden in 1k-token prompts. The full cache finds them; the ``bounded``
   recipe at 20% finds them too; a sliding window of the same 20% (``local``) cannot.
2. Long generation: a story written with the ``generation`` recipe at 128 slots. Its KV bytes stay
   flat while a full cache's grow with every token.

Each answer is printed with its KV bytes against full's, and one picture shows both parts
(``--plot``; skipped with a note when matplotlib is not installed).
"""

from __future__ import annotations

import importlib.util
import time

from h2okv.cli.args import add_threads_arg, apply_threads, examples, positive_int

DEFAULT_PLOT = "results/demo.png"
MIB = 1024 * 1024
# colours of the picture, one per configuration (the recipe's green in both panels)
COLORS = {"full": "black", "recipe bounded": "tab:green", "local": "tab:blue", "recipe generation": "tab:green"}


EXAMPLES = examples(
    "h2okv demo",
    "h2okv demo --model qwen2.5-0.5b",
)


def register(sub) -> None:
    p = sub.add_parser("demo", help="in about a minute: a passkey the bounded recipe keeps at 20%% and a sliding "
                                    "window loses, then a long generation in flat KV memory", epilog=EXAMPLES)
    p.add_argument("--model", default=None,
                   help="the model (default: the embedded SmolLM2-135M-Instruct); e.g. qwen2.5-0.5b after `make eval-data`")
    p.add_argument("--new-tokens", type=positive_int, default=400,
                   help="tokens of the long generation (default: 400)")
    p.add_argument("--plot", default=DEFAULT_PLOT,
                   help=f"the picture, a .png (default: {DEFAULT_PLOT}); --plot '' skips it")
    add_threads_arg(p, default=1)
    p.set_defaults(func=run)


class Clock:
    """Seconds since the demo started, in front of each progress line (flushed: ``make`` pipes it)."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():5.1f} s] {text}", flush=True)


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def retrieval_part(model, tokenizer, clock: Clock) -> dict:
    """Every case under every configuration: ``{case title: [Answer per configuration]}``."""
    from h2okv.demo_cases import RETRIEVAL_CONFIGS, answer, retrieval_cases

    cases = retrieval_cases(tokenizer)
    print("\nPart 1, retrieval: a passkey hidden in a long prompt. full keeps every token; the bounded recipe "
          "and a sliding window (local) keep 20% of them.", flush=True)
    results = {}
    for index, case in enumerate(cases, 1):
        clock.say(f"case {index}/{len(cases)}: {case.title}")
        print(f"    {'cache':<15} {'answer (8 tokens)':<28} {'':<6} {'KV MiB':>7}  of full", flush=True)
        results[case.title] = []
        for config, keywords in RETRIEVAL_CONFIGS:
            got = answer(model, tokenizer, case, config, keywords)
            results[case.title].append(got)
            full = results[case.title][0].kv_bytes
            shown = repr(got.text.strip()[:24]) if got.text.strip() else "(nothing)"
            print(f"    {config:<15} {shown:<28} {'right' if got.right else 'WRONG':<6} {mib(got.kv_bytes):>7}"
                  f"  {got.kv_bytes / full:>7.0%}", flush=True)
    for c, (config, _) in enumerate(RETRIEVAL_CONFIGS):
        right = sum(answers[c].right for answers in results.values())
        print(f"  {config}: {right} of {len(cases)} right", flush=True)
    return results


def generation_part(model, tokenizer, new_tokens: int, clock: Clock):
    from h2okv.demo_cases import GENERATION_SLOTS, long_generation

    print(f"\nPart 2, long generation: {new_tokens} tokens of a story with the generation recipe at "
          f"{GENERATION_SLOTS} slots per layer and KV head, beside what a full cache holds for the same tokens.",
          flush=True)
    clock.say("generating; the KV line as it grows:")
    print(f"    {'tokens seen':>11}  {'full MiB':>8}  {'recipe MiB':>10}", flush=True)

    def row(seen, kv, full):
        if seen % 100 == 0:  # a row every 100 tokens; the picture gets every 25
            print(f"    {seen:>11}  {mib(full):>8}  {mib(kv):>10}", flush=True)

    result = long_generation(model, tokenizer, new_tokens, on_point=row)
    seen, kv, full = result.points[-1]
    print(f"    {seen:>11}  {mib(full):>8}  {mib(kv):>10}  (end: {kv / full:.0%} of full)", flush=True)
    per_token = (full - result.points[0][2]) / (seen - result.points[0][0])
    print(f"  the recipe stops growing at its {GENERATION_SLOTS} slots (it allocates a chunk ahead, so early on "
          f"it holds a little more than full); full grows by {per_token / 1024:.0f} KiB a token", flush=True)
    text = " ".join(result.text.split())
    print(f"  the story begins {text[:110]!r}\n  and ends {text[-110:]!r}", flush=True)
    return result


def plot(path: str, results: dict, generation) -> None:
    """Left: KV MiB per case and configuration, each bar marked right or wrong. Right: the KV line of
    the long generation, full rising and the recipe flat."""
    from h2okv.demo_cases import GENERATION_SLOTS
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(ncols=2, width=5.6, height=4.0)
    left, right = axes[0]
    titles = list(results)
    configs = [a.config for a in results[titles[0]]]
    width = 0.8 / len(configs)
    top = max(a.kv_bytes for answers in results.values() for a in answers) / MIB
    for c, config in enumerate(configs):
        xs = [i + (c - (len(configs) - 1) / 2) * width for i in range(len(titles))]
        values = [results[t][c].kv_bytes / MIB for t in titles]
        left.bar(xs, values, width * 0.9, color=COLORS.get(config, "tab:gray"), label=config)
        for x, value, t in zip(xs, values, titles):
            good = results[t][c].right
            mark = "✓ right" if good else "✗ wrong"
            left.text(x, value + top * 0.02, f"{mark}\n{value:.1f} MiB", ha="center", va="bottom",
                      fontsize=8, color="tab:green" if good else "tab:red", fontweight="bold")
    left.set_xticks(range(len(titles)), labels=[t.replace(" of a ", "\nof a ") for t in titles], fontsize=8)
    left.set_ylim(0, top * 1.25)
    left.set_ylabel("KV cache after the answer (MiB)")
    left.set_title("Retrieval: same answer at 20% of the memory?", fontsize=10)
    left.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.9))

    seen = [p[0] for p in generation.points]
    right.plot(seen, [p[2] / MIB for p in generation.points], color=COLORS["full"], label="full (every token kept)")
    right.plot(seen, [p[1] / MIB for p in generation.points], color=COLORS["recipe generation"], linewidth=2,
               label=f"recipe generation, {GENERATION_SLOTS} slots")
    seen_end, kv_end, full_end = generation.points[-1]
    right.annotate(f"{kv_end / full_end:.0%} of full\nafter {seen_end} tokens", (seen_end, kv_end / MIB),
                   xytext=(0, 12), textcoords="offset points", ha="right", fontsize=8,
                   color=COLORS["recipe generation"])
    right.set_xlabel("tokens seen (prompt + generated)")
    right.set_ylabel("KV cache (MiB)")
    right.set_ylim(0, None)
    right.set_title("Long generation: KV memory as the text grows", fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    right.grid(alpha=0.3)
    save_figure(fig, path)


def has_matplotlib() -> bool:
    # matplotlib comes with the eval extra; the demo runs on the core install and only skips the picture
    return importlib.util.find_spec("matplotlib") is not None


def run(args) -> int:
    from h2okv.eval.output import check_output_paths

    check_output_paths(None, args.plot)  # a bad path fails now, not after a minute
    clock = Clock()
    apply_threads(args.threads)
    from h2okv.models import load_model

    model, tokenizer = load_model(args.model)
    clock.say(f"loaded {args.model or 'the embedded SmolLM2-135M-Instruct'} ({args.threads} CPU thread"
              f"{'s' if args.threads > 1 else ''})")
    results = retrieval_part(model, tokenizer, clock)
    generation = generation_part(model, tokenizer, args.new_tokens, clock)
    print()
    if args.plot and not has_matplotlib():
        print("picture skipped: matplotlib is not installed (pip install 'h2okv[eval]')")
    elif args.plot:
        plot(args.plot, results, generation)
        print(f"picture: {args.plot}")
    print(f"done in {clock.elapsed():.1f} s", flush=True)
    return 0
