#!/usr/bin/env bash
# Serving on one GPU (issue 36, part 3), in one command that fits one 10-minute call of the device tool:
#   1. `adaptlm serve` on the device, the engine in its own process with WORKERS HTTP workers (ADAPTLM_WORKERS);
#   2. scoring over HTTP at STREAMS clients (python -m bench.serve_load): bytes/s, requests/s, p50 / p99;
#   3. paced typists (5 keys/s, each a session that observes its messages: locust's Typist, LOCUST_PROCS processes)
#      at TYPISTS users (python -m bench.capacity --url): suggest p50 / p99 and whether loadtest/slo.toml held;
#   4. observe throughput of OBSERVE_SESSIONS adapting sessions at once against one at a time (python -m bench.server
#      --only observe: its own two servers, max_batch 1 and 2 x OBSERVE_SESSIONS);
#   5. the GPU's utilisation meanwhile (nvidia-smi dmon, one line a second) and its mean over steps 2-3;
#   6. scoring again at STREAMS with the model step's CUDA graphs off (ADAPTLM_CUDA_GRAPHS=off; steps 2-3 run with
#      GRAPHS, default auto: on for CUDA), SECONDS_OFF a level, and the two side by side (graphs.md: bytes/s on, off,
#      on / off);
#   0. first, the model step alone (python -m bench.step_graphs): ms a call, CUDA graphs against the model's own
#      path, at STEP_ROWS rows (scoring segments, static scores, peeks) and STEP_SEARCH_ROWS (the search's steps);
#   T. before all, the `gpu` tests of serving (GPU_TESTS=1; 0 skips them): tests/test_gpu.py, test_gpu_graphs.py,
#      test_gpu_syncs.py (no host sync in the steps) and tests/models/test_device_search.py (the device's word search
#      against the host's, and a round with no sync), in gpu_tests.txt: about a minute;
#  0b. the keyboard's word search alone, the host's against the device's (python -m bench.device_search, at
#      SEARCH_SESSIONS typists in lockstep, SEARCH_KEYSTROKES each): rounds, rows, device-to-host reads and bytes and
#      CPU time a keystroke, and that both answer the same (steps 3's typists search on the device: auto on CUDA).
# Results in $OUT (default runs/gpu_serve): gpu.txt (the card), gpu_tests.txt, step_graphs.md, device_search.txt, score.md, typists.md, slots.txt (the
# session slots' counters after the typists), observe.md,
# util.txt, util.md, score_graphs_off.md, graphs.md, server.log, server_graphs_off.log. Steps 0 and 6 add about
# 1.5 minutes, step 0b at most 1.5; STEP_BENCH=0, SEARCH_BENCH=0 or GRAPHS_OFF=0 skip them. SMOKE=1 runs every step at smoke size on the CPU (check it there first: ~3 minutes on 2 cores).
#
#   bash bench/gpu_prepare.sh                                    # here, once: .gpu/whl (wheels the GPU image lacks)
#   OUT=runs/gpu_serve bash bench/gpu_serve.sh                     # on the GPU machine, carry [".gpu"]
#
# The device tool brings back at most 8 files from its $OUT, and a lease is 15 minutes with the machine's start: run
# it as one call that archives the results and ends inside the call's limit, e.g. (carry [".gpu"], timeout_s 590)
#   D=$OUT; OUT=/tmp/gpu_serve STEP_BENCH=0 GRAPHS_OFF=0 timeout 560 bash bench/gpu_serve.sh; tar czf $D/gpu_serve.tgz -C /tmp/gpu_serve .
#
# Sizes: STREAMS (32,256,2048), TYPISTS (100,300,1000,3000), OBSERVE_SESSIONS (256), OBSERVE_BYTES (2048),
# SECONDS (20: each scoring level), GRAPHS (auto) and GRAPHS_OFF (1: step 6; 0: skip it),
# SUGGEST_ON_DEVICE (auto: the typists' word search on the device with CUDA),
# RUN_TIME (40s: each typists level), WORKERS (8), LOCUST_PROCS (6), MAX_QUEUE (8192), MAX_BATCH (512).
set -u
OUT=${OUT:-runs/gpu_serve}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
WORKERS=${WORKERS:-8}
STREAMS=${STREAMS:-32,256,2048}
TYPISTS=${TYPISTS:-100,300,1000,3000}
OBSERVE_SESSIONS=${OBSERVE_SESSIONS:-256}
OBSERVE_BYTES=${OBSERVE_BYTES:-2048}
SECONDS_EACH=${SECONDS:-20}
RUN_TIME=${RUN_TIME:-40s}
LOCUST_PROCS=${LOCUST_PROCS:-6}
MAX_QUEUE=${MAX_QUEUE:-8192}
MAX_BATCH=${MAX_BATCH:-512}
CHECKPOINT=${CHECKPOINT:-checkpoints/default}
GRAPHS=${GRAPHS:-auto}
GRAPHS_OFF=${GRAPHS_OFF:-1}
SECONDS_OFF=${SECONDS_OFF:-10}
STEP_BENCH=${STEP_BENCH:-1}
STEP_ROWS=${STEP_ROWS:-32,256,2048}
STEP_SEARCH_ROWS=${STEP_SEARCH_ROWS:-256,2048}
STEP_STATIC=1024
SEARCH_BENCH=${SEARCH_BENCH:-1}
GPU_TESTS=${GPU_TESTS:-1}
SEARCH_SESSIONS=${SEARCH_SESSIONS:-32,256}
SEARCH_KEYSTROKES=${SEARCH_KEYSTROKES:-12}
SUGGEST_ON_DEVICE=${SUGGEST_ON_DEVICE:-auto}
if [ "${SMOKE:-0}" = 1 ]; then
    DEVICE=cpu WORKERS=2 STREAMS=2,8 TYPISTS=2,4 OBSERVE_SESSIONS=4 OBSERVE_BYTES=256 SECONDS_EACH=4 RUN_TIME=8s
    LOCUST_PROCS=1 GRAPHS=on  # the padded step runs eagerly on the CPU: the setting and its path, served
    SUGGEST_ON_DEVICE=on  # the typists' searches take the device's path on the CPU too (auto: with CUDA only)
    SECONDS_OFF=4 STEP_ROWS=3,8 STEP_SEARCH_ROWS=24 STEP_STATIC=64 SEARCH_SESSIONS=2 SEARCH_KEYSTROKES=4
    MAX_QUEUE=256 MAX_BATCH=64
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1 && [ "${SMOKE:-0}" != 1 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD:$PWD/clients  # clients/: the SDK's adaptlm_client (server.protocol's models)
else
    export PYTHONPATH=$PWD:$PWD/clients
fi
# the text the scoring clients send: the held-out book where bench/gpu_prepare.sh put the texts, else the
# repository's own excerpt (tests/data)
# repository's own excerpts (tests/data); the observing sessions read slices of a longer one
if [ -f .gpu/data/chesterton-brown.txt ]; then
    export ADAPTLM_DATA=$PWD/.gpu/data BOOK=chesterton-brown.txt LONG=$PWD/.gpu/data/bible-kjv.txt
else
    export ADAPTLM_DATA=$PWD/tests/data BOOK=valid.txt LONG=$PWD/tests/data/train.txt
fi
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }

(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi") > "$OUT/gpu.txt"
$PY -c "import torch, os; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cpus', os.cpu_count())" \
    >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
util_pid=""
if command -v nvidia-smi >/dev/null; then
    nvidia-smi dmon -s u -d 1 > "$OUT/util.txt" 2>&1 &
    util_pid=$!
fi

if [ "$GPU_TESTS" = 1 ]; then
    stamp "the gpu tests of serving"
    timeout 150 $PY -m pytest -q -p no:cacheprovider -m gpu --timeout 120 tests/test_gpu.py tests/test_gpu_graphs.py \
        tests/test_gpu_syncs.py tests/models/test_device_search.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi
if [ "$STEP_BENCH" = 1 ]; then
    stamp "the model step alone: CUDA graphs against the model's own path"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 150 $PY -m bench.step_graphs --checkpoint "$CHECKPOINT" \
        --device "$DEVICE" --rows "$STEP_ROWS" --search-rows "$STEP_SEARCH_ROWS" --static-steps "$STEP_STATIC" \
        --repeat 3 2>&1 | tee "$OUT/step_graphs.md"
fi
if [ "$SEARCH_BENCH" = 1 ]; then
    stamp "the word search alone: the host's against the device's"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 90 $PY -m bench.device_search --checkpoint "$CHECKPOINT" \
        --device "$DEVICE" --sessions "$SEARCH_SESSIONS" --keystrokes "$SEARCH_KEYSTROKES" 2>&1 \
        | tee "$OUT/device_search.txt"
fi

# start_server LOG GRAPHS: `adaptlm serve` in the background (its pid in $server, its address in $URL), once ready
start_server() {
    PORT=$($PY -c "from server.launch import free_port; print(free_port())")
    URL="http://127.0.0.1:$PORT"
    stamp "serving $CHECKPOINT on $DEVICE with $WORKERS workers at $URL (CUDA graphs: $2)"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ADAPTLM_DEVICE=$DEVICE ADAPTLM_WORKERS=$WORKERS ADAPTLM_MAX_QUEUE=$MAX_QUEUE \
        ADAPTLM_MAX_BATCH=$MAX_BATCH ADAPTLM_LOG_LEVEL=warning ADAPTLM_CUDA_GRAPHS=$2 \
        ADAPTLM_SUGGEST_ON_DEVICE=$SUGGEST_ON_DEVICE \
        $PY -m adaptlm serve --checkpoint "$CHECKPOINT" --port "$PORT" > "$1" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
        $PY -c "import sys, urllib.request as u; sys.exit(u.urlopen(sys.argv[1], timeout=2).status != 200)" \
            "$URL/readyz" >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$1"; exit 1; }
        sleep 1
    done
    sleep 3  # every worker up (readyz answers with the first)
}
start_server "$OUT/server.log" "$GRAPHS"
first=$(grep -cv '^#' "$OUT/util.txt" 2>/dev/null)

stamp "scoring at $STREAMS streams"
$PY -m bench.serve_load --url "$URL" --streams "$STREAMS" --seconds "$SECONDS_EACH" --file "$BOOK" | tee "$OUT/score.md"
stamp "typists at $TYPISTS"
ADAPTLM_LOADTEST_MESSAGES=$PWD/loadtest/messages.txt $PY -m bench.capacity --url "$URL" --classes Typist \
    --levels "$TYPISTS" --run-time "$RUN_TIME" --locust-processes "$LOCUST_PROCS" | tee "$OUT/typists.md"
last=$(grep -cv '^#' "$OUT/util.txt" 2>/dev/null)
# the session slots after the typists (ADAPTLM_SESSION_SLOTS, on by default on CUDA): hits against misses and declines
$PY -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1] + '/metrics', timeout=5).read().decode())" \
    "$URL" | grep '^adaptlm_session_slot' | tee "$OUT/slots.txt" || echo "no session slots exported" | tee "$OUT/slots.txt"
kill -TERM $server; wait $server

stamp "observe: $OBSERVE_SESSIONS sessions at once against one at a time"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ADAPTLM_DEVICE=$DEVICE \
    $PY -m bench.server --checkpoint "$CHECKPOINT" --only observe \
    --sessions "$OBSERVE_SESSIONS" \
    --max-batch "1,$((2 * OBSERVE_SESSIONS))" --observe-bytes "$OBSERVE_BYTES" --messages "$LONG" --max-seconds 120 \
    | tee "$OUT/observe.md"

if [ -n "$util_pid" ]; then
    kill $util_pid
    # dmon: "#" header lines, then one line a second (gpu, sm%, mem%, ...): the mean sm% while steps 2-3 ran
    awk -v a="${first:-0}" -v b="${last:-0}" '!/^#/ {c++; if (c > a && c <= b) {s += $2; k++}}
        END {printf "| GPU SM busy, mean over scoring and typists | %.0f%% over %d s |\n", (k ? s / k : 0), k}' \
        "$OUT/util.txt" | tee "$OUT/util.md"
fi
if [ "$GRAPHS_OFF" = 1 ]; then
    start_server "$OUT/server_graphs_off.log" off
    stamp "scoring at $STREAMS streams, CUDA graphs off"
    $PY -m bench.serve_load --url "$URL" --streams "$STREAMS" --seconds "$SECONDS_OFF" --file "$BOOK" \
        | tee "$OUT/score_graphs_off.md"
    kill -TERM $server; wait $server
    # the two scoring tables side by side: bytes/s with the graphs (GRAPHS) and without, and their ratio
    $PY - "$OUT/score.md" "$OUT/score_graphs_off.md" "$GRAPHS" <<'PY' | tee "$OUT/graphs.md"
import sys

def rates(path):
    rows = [line.split("|") for line in open(path) if line.startswith("| ") and line[2].isdigit()]
    return {int(r[1]): float(r[2].replace(",", "")) for r in rows}

on, off = rates(sys.argv[1]), rates(sys.argv[2])
print(f"| streams | bytes/s, CUDA graphs {sys.argv[3]} | bytes/s, off | ratio |")
print("| ---: | ---: | ---: | ---: |")
for n in sorted(on.keys() & off.keys()):
    ratio = f"{on[n] / off[n]:.2f}x" if off[n] else "-"
    print(f"| {n} | {on[n]:,.0f} | {off[n]:,.0f} | {ratio} |")
PY
fi
stamp "done"
