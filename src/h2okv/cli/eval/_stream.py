"""``h2okv eval ppl --window-tokens W``: a long stream in pieces, perplexity per window
(``h2okv.eval.stream``), for each policy x slots x position scheme."""

from __future__ import annotations

from h2okv.cli.args import parse_policies
from h2okv.errors import H2OError


def parse_slots(text: str | None) -> list[int]:
    try:
        slots = [int(p) for p in (text or "").split(",") if p.strip()]
    except ValueError:
        raise H2OError(f"--slots must be comma-separated integers, got {text!r}") from None
    if not slots or min(slots) < 2:
        raise H2OError("stream mode (--window-tokens) needs --slots, each at least 2 (e.g. --slots 512,1024)")
    return slots


def parse_position_list(text: str) -> list[str]:
    from h2okv.core.positions import parse_positions

    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        parse_positions(name)
    if not names:
        raise H2OError("--positions is empty; give e.g. true,rolling")
    return names


def check_stream_args(args) -> None:
    parse_slots(args.slots)
    parse_position_list(args.positions)
    if args.segments != 1:
        raise H2OError("stream mode (--window-tokens) reads one stream: --segments must be 1")
    if args.reference_context is not None and args.reference_context < 0:
        raise H2OError(f"--reference-context must be >= 0 tokens, got {args.reference_context}")


def stream_runs(policies, slots, positions):
    """(policy, slots, positions) for every run: a policy that keeps everything once, true positions."""
    from h2okv.policies import policy_class

    for policy in policies:
        if not policy_class(policy).evicts:
            yield policy, None, "true"
            continue
        for budget in slots:
            for scheme in positions:
                yield policy, budget, scheme


def stream_on_rank(args, model, tokenizer) -> int:
    from h2okv.eval.output import format_table, write_json
    from h2okv.eval.stream import plot_stream, reference_ppl, stream_ppl
    from h2okv.eval.text import text_segments
    from h2okv.parallel.ranks import is_main_rank

    text, label = args.loaded_text
    ids = text_segments(tokenizer, text, args.tokens, 1)[0]
    done: list[dict] = []
    main = is_main_rank()  # under --tp every rank scores (each holds its heads), rank 0 reports

    def save(run) -> None:  # after every window: a long run leaves its numbers behind as it goes
        if args.json and main:
            write_json({"text": label, "runs": done + [run.as_dict()]}, args.json)

    def report(run, heading: str) -> None:
        done.append(run.as_dict())
        if main:
            print(heading + (f" (stopped: {run.stopped})" if run.stopped else ""))
            print(format_table(["tokens", "ppl", "tokens/s", "tokens/CPU-s", "KV bytes"],
                               [[w.end, round(w.ppl, 3), w.tokens_per_s, w.cpu_tokens_per_s, w.kv_bytes]
                                for w in run.windows]))

    if args.reference_context is not None:
        report(reference_ppl(model, ids, args.reference_context, args.window_tokens, on_window=save),
               f"reference: full attention over each window and the {args.reference_context} tokens before it")
    for policy, slots, positions in stream_runs(parse_policies(args.policies), parse_slots(args.slots),
                                                 parse_position_list(args.positions)):
        report(stream_ppl(model, ids, policy, slots, positions, args.window_tokens, args.seed, on_window=save),
               f"{policy} slots={slots or 'all'} positions={positions}")
    if not main:
        return 0
    if args.json:
        write_json({"text": label, "runs": done}, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        context = model.config.get_text_config().max_position_embeddings
        title = f"Perplexity per {args.window_tokens}-token window, {args.tokens} tokens of {label}"
        print(f"wrote {plot_stream(done, args.plot, title, context)}")
    return 0
