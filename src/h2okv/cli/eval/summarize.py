"""``h2okv eval summarize``: k-shot summarization per eviction policy, scored with ROUGE
(``h2okv.eval.summarize``)."""

from __future__ import annotations

from h2okv.cli.args import add_model_args, apply_threads, check_policy, examples, positive_int
from h2okv.errors import H2OError
from h2okv.eval.summarize import HUB_DATASETS, OFFLINE_DATASET  # light: no torch at import

EXAMPLES = examples(
    "h2okv eval summarize --data xsum_0shot.jsonl --shots 0 --limit 100 --policies full,h2o,local --budget 0.2 --json x.json",
)


def register(sub) -> None:
    p = sub.add_parser("summarize", help="k-shot summarization (ROUGE-1/2/L) with each eviction policy", epilog=EXAMPLES)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="JSONL with fields document, summary")
    src.add_argument("--dataset", choices=[*HUB_DATASETS, OFFLINE_DATASET],
                     help=f"hub dataset (needs network) or the offline {OFFLINE_DATASET} set")
    p.add_argument("--split", default="test", help="hub split (default test)")
    p.add_argument("--shots", type=int, default=1, help="solved examples per prompt (default 1)")
    p.add_argument("--policies", default="full,h2o,local", help="comma-separated (default: full,h2o,local)")
    p.add_argument("--budget", type=float, default=0.2,
                   help="KV budget as a fraction of each prompt, half heavy / half recent (default 0.2)")
    p.add_argument("--limit", type=positive_int, default=None, help="summarize the first N records")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="default: the records' max_tokens (request format), else 64")
    p.add_argument("--max-doc-words", type=positive_int, default=None, help="truncate documents in prompts")
    p.add_argument("--batch-size", type=positive_int, default=1, help="records summarized together (default 1)")
    p.add_argument("--chunk-size", type=positive_int, default=512,
                   help="prompt tokens read between evictions (default 512; 1 = per-token)")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of examples")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message in the model's chat template (instruction-tuned "
                        "models that answer raw text with a refusal)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", required=True, help="write results here")
    p.add_argument("--plot", default=None, help="bar chart PNG (default: the --json path with .png)")
    add_model_args(p)
    p.set_defaults(func=run)




def run(args) -> int:
    import json
    from pathlib import Path

    from h2okv.eval.summarize import SummarizeSpec, format_table, load_records, plot_rouge, summarize_policies
    from h2okv.models import load_model

    policies = [check_policy(x.strip()) for x in args.policies.split(",") if x.strip()]
    if not policies:
        raise H2OError("give at least one policy")
    if not 0.0 < args.budget <= 1.0:
        raise H2OError(f"--budget must be in (0, 1], got {args.budget}")
    if args.shots < 0:
        raise H2OError(f"--shots must be >= 0, got {args.shots}")
    records, source = load_records(args.data, args.dataset, args.split, args.limit, args.shots)
    if args.shots >= len(records):
        raise H2OError(f"--shots {args.shots} needs at least {args.shots + 1} records, the data has {len(records)}")

    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    spec = SummarizeSpec(
        policies, args.budget, args.shots, limit=args.limit, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, chunk_size=args.chunk_size, seed=args.seed, max_doc_words=args.max_doc_words,
        chat=args.chat,
    )
    out = summarize_policies(model, tokenizer, records, spec)
    print(format_table(out["results"]))
    report = {
        "source": source,
        "records": len(records),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "budget_meaning": "fraction of each prompt's tokens (k examples + test document), half heavy / half recent",
        **out,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plot = plot_rouge(out["results"], args.plot or path.with_suffix(".png"),
                      title=f"{source}, {args.shots}-shot, budget {args.budget:.0%} of prompt")
    print(f"wrote {path} and {plot}")
    return 0
