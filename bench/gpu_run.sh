#!/usr/bin/env bash
# One GPU run, everything a session with a lent GPU machine measures, in one command (device time is scarce):
#   1. the transformer families' `gpu` presets train on the public-domain mix, side by side on the one GPU;
#   2. meanwhile the `gpu`-marked tests run (correctness only: they share the GPU with the training);
#   3. then, on the quiet GPU, `python -m bench.attention_variants` (the attention kernel's settings, shipped and its
#      forward in key splits: correct compiled, their times, the fastest) and `python -m bench.kernels` (the Triton
#      kernels against their references) under the fastest correct attention setting.
# FAMILIES=0 skips the training and the families table (step 1): the kernel work alone. VARIANTS='a;b;c' names step 3's
# attention settings instead (e.g. 'shipped;splits=4'). GPU_TESTS=attention runs only the attention kernel's compiled
# tests, GPU_TESTS=fastest its `gpu` tests after step 3's checks, under the fastest correct setting, GPU_TESTS=0 none
# (bench.attention_variants checks every attention setting). Results go to $OUT (default runs/gpu): gpu.txt (the card,
# then the gpu tests' log: the device tool brings back 8 files), attention_variants.md, .json and .log, kernels.md,
# kernels.json, host_overhead.md and .json (the launchers' host time per call, real launches), families.md and
# families.json (bench.families: the trained checkpoints beside the default), one <arch>.tgz per trained checkpoint
# (the checkpoint and its train.jsonl; its resumable state left out).
#
#   DATA=.gpu/data TRAIN_MIN=3 bash bench/gpu_run.sh
#   FAMILIES=0 GPU_TESTS=fastest VARIANTS_S=270 TESTS_S=90 BENCH_S=160 HOST_S=30 bash bench/gpu_run.sh  # ~5 min
#
# DATA holds the training texts (see the Makefile's DEFAULT_TRAIN: the mix the default checkpoint was trained on),
# austen-persuasion.txt for validation and chesterton-brown.txt (the held-out book) for the families table. Where
# .gpu/whl exists (wheels of packages the GPU image lacks: fastapi, starlette, uvicorn, pydantic, pydantic_core,
# pydantic-settings, python-dotenv, annotated-types, typing-inspection, redis, for Python 3.12), they are installed to
# /tmp/site first. SMOKE=1 runs the whole sequence at smoke size on any device (check it on a CPU first).
#
# Preparing it here, once per checkout: `bash bench/gpu_prepare.sh` (the texts and the wheels, at .venv's versions;
# `.gpu/` is ignored through .git/info/exclude; the device tool carries it with carry [".gpu"]).
# Two runs, their costs: docs/benchmarks.md, "GPU". A call:
# `DATA=.gpu/data TRAIN_MIN=2 BENCH_S=110 bash bench/gpu_run.sh` with carry [".gpu"] took 250-320 s of command time
# plus ~80 s of machine start. The kernels alone (FAMILIES=0, carry [".gpu/whl"]: the texts are for training) took
# 262-308 s plus ~40 s of start in session 18 ("memory_attention on the H200: the settings settled").
set -u
OUT=${OUT:-runs/gpu}
DATA=${DATA:-.gpu/data}
TRAIN_MIN=${TRAIN_MIN:-3}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${WHEELS:-1}" = 1 ] && [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD:$PWD/clients  # clients/: the SDK's adaptlm_client (server.protocol's models)
else
    export PYTHONPATH=$PWD:$PWD/clients
fi
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }

(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi") > "$OUT/gpu.txt"
$PY -c "import torch, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, platform.python_version())" \
    >> "$OUT/gpu.txt" 2>&1
$PY -c "import triton; print('triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

TRAIN=""
for f in austen-emma austen-sense bible-kjv blake-poems chesterton-ball melville-moby_dick milton-paradise \
         shakespeare-caesar shakespeare-hamlet shakespeare-macbeth input; do
    TRAIN="$TRAIN $DATA/$f.txt"
done
PRESET=gpu
EXTRA=""
if [ "${SMOKE:-0}" = 1 ]; then PRESET=tiny; EXTRA="--max-steps 20"; fi

pids=""
ARCHS="char-transformer compressive"
if [ "${FAMILIES:-1}" = 0 ]; then ARCHS=""; fi
for arch in $ARCHS; do
    stamp "training $arch ($PRESET, at most $TRAIN_MIN min)"
    # shellcheck disable=SC2086
    # the reference kernels train the shipped checkpoints: they must not depend on kernels this run tests first
    ADAPTLM_KERNELS=reference $PY -m trainer --arch "$arch" --preset $PRESET --data $TRAIN --valid "$DATA/austen-persuasion.txt" \
        --out "$OUT/$arch" --max-minutes "$TRAIN_MIN" --quiet $EXTRA > "$OUT/train-$arch.log" 2>&1 &
    pids="$pids $!"
done

stamp "gpu tests"
LOG="$OUT/gpu.txt"
if [ "${GPU_TESTS:-all}" = fastest ]; then
    echo "GPU_TESTS=fastest: after the attention settings' checks" | tee -a "$LOG"
elif [ "${SMOKE:-0}" = 1 ]; then
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py >> "$LOG" 2>&1
elif [ "${GPU_TESTS:-all}" = attention ]; then  # the attention kernel's compiled tests alone
    TRITON_INTERPRET=0 timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu --timeout 200 \
        tests/kernels/test_attention.py >> "$LOG" 2>&1
elif [ "${GPU_TESTS:-all}" != 0 ]; then
    # the gpu tests, and the kernel tests (`interpreter` on a CPU) compiled on the GPU at their small odd shapes
    TRITON_INTERPRET=0 timeout 240 $PY -m pytest -q -p no:cacheprovider -m "gpu or interpreter" --timeout 200 \
        tests/kernels tests/test_gpu.py tests/trainer tests/models/test_branches.py >> "$LOG" 2>&1
else
    echo "GPU_TESTS=0: skipped" >> "$LOG"
fi
tail -n 15 "$LOG"

for pid in $pids; do wait "$pid"; done
if [ -n "$ARCHS" ]; then
    stamp "families table"
    timeout 120 $PY -m bench.families --checkpoints checkpoints/default "$OUT/char-transformer" "$OUT/compressive" \
        --text "$DATA/chesterton-brown.txt" --json "$OUT/families.json" > "$OUT/families.md" 2>&1
    cat "$OUT/families.md"
fi
for arch in $ARCHS; do
    stamp "trained $arch: $(tail -n 1 "$OUT/train-$arch.log" | cut -c1-300)"
    mkdir -p "$OUT/$arch" && mv "$OUT/train-$arch.log" "$OUT/$arch/"
    tar -czf "$OUT/$arch.tgz" -C "$OUT" --exclude last "$arch" && rm -rf "${OUT:?}/$arch"
done

stamp "attention settings"
rm -f "$OUT/attention_variants.json"  # an earlier run's (another card, another build) must not name the fastest
VSMOKE=""
if [ "${SMOKE:-0}" = 1 ]; then VSMOKE="--smoke"; fi
if [ -n "${VARIANTS:-}" ]; then VSMOKE="$VSMOKE --settings $VARIANTS"; fi  # ';'-separated, no spaces: the candidates
env -u TRITON_INTERPRET timeout "${VARIANTS_S:-240}" $PY -m bench.attention_variants $VSMOKE \
    --json "$OUT/attention_variants.json" > "$OUT/attention_variants.md" 2> "$OUT/attention_variants.log"
cat "$OUT/attention_variants.md"

# bench.kernels under the fastest correct attention setting (the shipped one where the checks found none)
TUNING=$($PY -c "import json, sys; print(json.load(open(sys.argv[1])).get('fastest') or '')" \
    "$OUT/attention_variants.json" 2>/dev/null)
if [ "${GPU_TESTS:-all}" = fastest ]; then
    stamp "the attention kernel's gpu tests under ADAPTLM_ATTENTION_TUNING=${TUNING:-shipped}"
    ADAPTLM_ATTENTION_TUNING=${TUNING:-shipped} TRITON_INTERPRET=0 timeout "${TESTS_S:-120}" $PY -m pytest -q \
        -p no:cacheprovider -m gpu --timeout 100 tests/kernels/test_attention.py >> "$LOG" 2>&1
    tail -n 15 "$LOG"
fi
stamp "kernel benchmark (ADAPTLM_ATTENTION_TUNING=${TUNING:-shipped})"
QUICK=""
if [ "${SMOKE:-0}" = 1 ]; then QUICK="--quick"; fi
ADAPTLM_ATTENTION_TUNING=${TUNING:-shipped} TRITON_INTERPRET=0 timeout "${BENCH_S:-200}" $PY -m bench.kernels $QUICK \
    --json "$OUT/kernels.json" > "$OUT/kernels.md" 2>&1
cat "$OUT/kernels.md"
stamp "host time per call"
ADAPTLM_ATTENTION_TUNING=${TUNING:-shipped} TRITON_INTERPRET=0 timeout "${HOST_S:-60}" $PY -m bench.host_overhead \
    --calls "$([ "${SMOKE:-0}" = 1 ] && echo 20 || echo 2000)" --json "$OUT/host_overhead.json" > "$OUT/host_overhead.md" 2>&1
cat "$OUT/host_overhead.md"
stamp "done"
