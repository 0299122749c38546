#!/usr/bin/env bash
# One device command for a machine of several GPUs (1, 2 or 4+): the GPU tests and the timing jobs
# each get a GPU of their own and run side by side, then the multi-GPU ring runs take every GPU.
#
#     JOBS=tests,serving,fp8,generate,ring bash benchmarks/gpu_parallel.sh     # the default set
#
# Placement with G GPUs: tests on GPU 0 (compile-bound: gpu_suite.sh's parallel shards), serving on
# GPU 1, fp8 on GPU 2, generate on GPU 3 (with fewer GPUs the jobs queue on the ones there are,
# one at a time per GPU); the ring (benchmarks/ring_attention.py dist, torchrun) runs on 2 GPUs once
# the GPU 2 and 3 jobs are done, then on 4 once everything else is (skipped with fewer GPUs).
# Each timing job has a GPU to itself; timings from different GPUs are compared only through ratios
# taken on one GPU (each job measures its own baselines).
#
# Knobs: JOBS, OUT (./.device_out), TEST_TIMEOUT_S (240), SERVING_BUDGET_S (120), FP8_SEQLENS
# (4096,16384), GENERATE_ARGS, RING2_ARGS, RING4_ARGS.
# Results: everything under $OUT/work, packed into $OUT/results.tgz (the device tool returns at most
# 8 files); $OUT/summary.log holds each job's exit code and its table. The summary prints last.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/.device_out}
W=$OUT/work
mkdir -p "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (the device machines are shared: see benchmarks/ring_attention.py)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
JOBS=${JOBS:-tests,serving,fp8,generate,ring}
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
echo "== gpu_parallel: $NGPU GPUs, jobs $JOBS, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,power.draw --format=csv 2>&1 | tee "$W/nvidia-smi.csv"
[ "$NGPU" -ge 1 ] || { echo "gpu_parallel: no GPU"; exit 1; }
has() { [[ ",$JOBS," == *",$1,"* ]]; }
gpu_for() { echo $(( $1 % NGPU )); }   # job slot -> GPU

declare -A PIDS
run_job() {   # name, slot, command...
    local name=$1 slot=$2; shift 2
    local gpu; gpu=$(gpu_for "$slot")
    mkdir -p "$W/$name"
    # jobs sharing a GPU (fewer GPUs than slots) queue behind a lock per GPU
    ( flock 9; echo "== $name on GPU $gpu from $SECONDS s"; CUDA_VISIBLE_DEVICES=$gpu "$@"; echo "== $name exit $? at $SECONDS s" ) \
        9>"$W/.gpu$gpu.lock" >"$W/$name/log" 2>&1 &
    PIDS[$name]=$!
}

has tests && run_job tests 0 env OUT="$W/tests" TESTS=1 BENCH=0 MODELS=0 \
    TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-240}" bash benchmarks/gpu_suite.sh
has serving && run_job serving 1 timeout -k 10 $(( ${SERVING_BUDGET_S:-120} + 80 )) \
    python3 benchmarks/serving.py --quick --budget-s "${SERVING_BUDGET_S:-120}" --out "$W/serving"
has fp8 && run_job fp8 2 timeout -k 10 180 \
    python3 benchmarks/fp8_speed.py --head-dims 128 --seqlens "${FP8_SEQLENS:-4096,16384}" \
    --mods noop,causal,softcap --out "$W/fp8"
has generate && run_job generate 3 timeout -k 10 170 \
    python3 examples/generate.py ${GENERATE_ARGS:---budget-s 90} --out "$W/generate"

ring() {   # N, GPUs, timeout, arguments...
    local n=$1 gpus=$2 limit=$3; shift 3
    echo "== ring x$n on GPUs $gpus from $SECONDS s" >>"$W/ring/log"
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$limit" python3 -m torch.distributed.run --nproc-per-node "$n" \
        benchmarks/ring_attention.py dist "$@" --out "$W/ring" >>"$W/ring/log" 2>&1
    echo "== ring x$n exit $? at $SECONDS s" >>"$W/ring/log"
}
mkdir -p "$W/ring"
ring_on=$(has ring && [ "$NGPU" -ge 2 ] && echo 1)
# The ring runs: 2 GPUs at 128k then 64k tokens per GPU (256k, 128k in all), 4 GPUs at 128k per GPU
# (512k). Time model (benchmarks/ring_attention.py plan, 450 TFLOP/s): 32 s and 48 s of attention;
# startup, the check and the first calls' compiles come on top. Alone (JOBS=ring) each world size
# gets about 5 minutes, both together under the device's 10-minute command; beside the other jobs
# they get what those leave (--budget-s skips what would not fit: the 64k size first).
if [ "$JOBS" = ring ]; then R2_LIMIT=280 R2_BUDGET=200 R4_LIMIT=290 R4_BUDGET=200
else R2_LIMIT=170 R2_BUDGET=100 R4_LIMIT=190 R4_BUDGET=110; fi
RING2_ARGS=${RING2_ARGS:---per-gpu 131072 65536 --budget-s $R2_BUDGET}
RING4_ARGS=${RING4_ARGS:---per-gpu 131072 --check-per-gpu 32768 --budget-s $R4_BUDGET}
if [ -n "$ring_on" ] && [ "$NGPU" -ge 4 ]; then
    # 2 GPUs as soon as the GPU 2 and 3 jobs are done (the tests may still run on GPU 0)
    for name in fp8 generate; do [ -n "${PIDS[$name]:-}" ] && wait "${PIDS[$name]}"; done
    ring 2 2,3 "$R2_LIMIT" $RING2_ARGS
fi
for name in "${!PIDS[@]}"; do wait "${PIDS[$name]}"; done
if [ -n "$ring_on" ] && [ "$NGPU" -lt 4 ]; then
    ring 2 0,1 "$R2_LIMIT" $RING2_ARGS
elif [ -n "$ring_on" ]; then
    ring 4 0,1,2,3 "$R4_LIMIT" $RING4_ARGS
fi

{
    echo "================================ summary ($SECONDS s) ================================"
    for name in tests serving fp8 generate ring; do
        [ -f "$W/$name/log" ] || continue
        echo "---- $name: $(grep -E '^== .*exit' "$W/$name/log" | tr '\n' ' ')"
        case $name in
            tests) sed -n '/===== summary =====/,/^benchmark exit code/p' "$W/$name/log" | head -40 ;;
            *) for md in "$W/$name"/*.md; do [ -f "$md" ] && { echo "[$md]"; head -c 6000 "$md"; echo; }; done
               [ -n "$(ls "$W/$name"/*.md 2>/dev/null)" ] || tail -25 "$W/$name/log" ;;
        esac
    done
} >"$OUT/summary.log" 2>&1
tar czf "$OUT/results.tgz" -C "$OUT" work
cat "$OUT/summary.log"
