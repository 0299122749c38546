#!/usr/bin/env bash
# The coverage harness's full GPU run (issue 21) in one device command: every family of
# benchmarks/coverage.py checked in bf16 by many processes at once, the timed families against
# stock Inductor on GPUs of their own, then one merged table.
#
#     OUT=$OUT bash benchmarks/coverage_gpu.sh [budget_s]          # from the repo root
#     RESUME=benchmarks/results/coverage-....json OUT=$OUT bash benchmarks/coverage_gpu.sh 440
#
# Layout on G GPUs and C cores: TIMING_SHARDS timing processes (1 with 1-3 GPUs, 2 with 4-7, 3
# with 8+), each alone on one of the last GPUs (with one GPU, beside the checks) and on
# TIMING_CORES cores of its own; SHARDS checking processes (default: one per remaining core)
# share the other GPUs (each hands its cached GPU memory back after every family). Checking is bound by the CPU
# (Dynamo, AOT autograd, Inductor, Triton compiles of tiny models), so each process compiles in
# its own thread (TORCHINDUCTOR_COMPILE_THREADS=1, OMP_NUM_THREADS=1) and the on-disk
# Triton/Inductor caches, shared by default, compile each identical kernel once. Families go to the
# first process that claims them (--claim-dir), most important first (coverage.prioritized), so
# the processes stay busy to the end; every process stops at one wall-clock deadline
# (budget_s after the start, default 440), and a family cut by it is listed as not reached. A
# process whose CUDA context broke (exit 3) or that died is started again while time is left; a
# timing process runs each timed family in a child process of its own, so one that breaks its CUDA
# context (a device-side assert) costs that family only.
#
# RESUME: a merged JSON from an earlier run (in the repo): the families it settled are skipped
# (not reached, timed out, crashed or out of tolerance run again), and it is merged first, so the
# new table is the union (later rows win). FAMILIES/SOURCES: a subset. DEVICE=cpu: a dry run on
# the CPU (Triton's interpreter, float32, no timing; SHARDS default 2).
# Knobs: SHARDS, TIMING (1), TIMING_SHARDS, TIMING_CORES (6), TIMING_EVERY_SIZE (1: also time
# fa3 with the size rule off; at the timed sizes most sites are below it),
# FAMILY_LIMIT_S (300), TIMING_LIMIT_S (300), DEVICE (cuda), DTYPE, FAMILIES, SOURCES, RESUME,
# WHEELS (.whl, or ../.whl from a snapshot clone).
# diffusers travels as a wheel: with .whl/*.whl in the repo (docs/coverage.md), they are installed
# into /tmp/site first.
# Results in $OUT (at most 8 files come back): coverage-<gpu>-<date>.md and .json (merged),
# logs.tgz (every process's log and JSON, the claims) and summary.log, printed last.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
BUDGET_S=${1:-${BUDGET_S:-440}}
START=$(date +%s)
STOP_AT=$((START + BUDGET_S))
OUT=${OUT:-$ROOT/.device_out}
W=$(mktemp -d /tmp/coverage_gpu.XXXXXX)
mkdir -p "$OUT" "$W/logs" "$W/json" "$W/claims"
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYPATH=$ROOT
# WHEELS: the carried wheels; from a snapshot clone inside the repo (.snap), the repo's own .whl
WHEELS=${WHEELS:-.whl}
[ -d "$WHEELS" ] || [ ! -d ../.whl ] || WHEELS=../.whl
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || { echo "coverage_gpu: wheel install failed"; exit 1; }
    PYPATH=$ROOT:/tmp/site
fi
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
# A run without diffusers lists every diffusers family as "package not installed": say so first
# (the 2026-11-27 20:52 run lost its diffusers rows that way, run from .snap without ../.whl).
python3 -c "import diffusers" 2>/dev/null || echo "coverage_gpu: WARNING: diffusers does not import" \
    "(no wheel in $WHEELS): its families will not be checked; carry .whl (docs/coverage.md)"

NCPU=$(nproc)
if [ "$DEVICE" = cpu ]; then
    NGPU=0
else
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$NGPU" -ge 1 ] || { echo "coverage_gpu: no GPU (DEVICE=cpu for a dry run)"; exit 1; }
fi
TIMING=${TIMING:-1}
[ "$NGPU" -ge 1 ] || TIMING=0
if [ "$TIMING" = 1 ]; then
    TIMING_SHARDS=${TIMING_SHARDS:-$(( NGPU >= 8 ? 3 : (NGPU >= 4 ? 2 : 1) ))}
else
    TIMING_SHARDS=0
fi
TIMING_CORES=${TIMING_CORES:-6}
TIMING_EVERY_SIZE=${TIMING_EVERY_SIZE:-1}   # also time fa3 with the size rule off (see the table)
CHECK_GPUS=$(( NGPU > TIMING_SHARDS ? NGPU - TIMING_SHARDS : NGPU ))   # the first ones
CHECK_CORES=$(( NCPU - TIMING_SHARDS * TIMING_CORES ))
[ "$CHECK_CORES" -ge 1 ] || CHECK_CORES=$NCPU
SHARDS=${SHARDS:-$([ "$DEVICE" = cpu ] && echo 2 || echo "$CHECK_CORES")}
pin() {   # first core, count: a taskset prefix where taskset exists and the cores do
    if command -v taskset >/dev/null && [ "$NCPU" -ge $(( $1 + $2 )) ] && [ "$TIMING_SHARDS" -gt 0 ]; then
        echo "taskset -c $1-$(( $1 + $2 - 1 ))"
    fi
}
COMMON=(--device "$DEVICE" --stop-at "$STOP_AT" --out "$W/json")
[ -n "${DTYPE:-}" ] && COMMON+=(--dtype "$DTYPE")
[ "$DEVICE" = cuda ] && [ -z "${DTYPE:-}" ] && COMMON+=(--dtype bfloat16)
[ -n "${RESUME:-}" ] && { [ -f "$RESUME" ] || { echo "coverage_gpu: RESUME=$RESUME not found"; exit 1; }
                          COMMON+=(--resume-from "$RESUME"); }
CHECK_ARGS=(--claim-dir "$W/claims" --family-limit-s "${FAMILY_LIMIT_S:-300}")
[ -n "${FAMILIES:-}" ] && CHECK_ARGS+=(--families "$FAMILIES")
[ -n "${SOURCES:-}" ] && CHECK_ARGS+=(--sources "$SOURCES")

echo "== coverage_gpu: $NGPU GPUs, $NCPU cores, $SHARDS checking processes on GPUs 0..$((CHECK_GPUS - 1))," \
     "$TIMING_SHARDS timing; budget ${BUDGET_S} s (deadline $(date -u -d "@$STOP_AT" +%H:%M:%SZ));" \
     "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)${RESUME:+; resuming $RESUME}"
[ "$NGPU" -ge 1 ] && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$W/logs/nvidia-smi.csv" 2>&1

check_shard() {   # i: one checking process, started again after a broken context or a death
    local i=$1 k=0 gpu=$(( CHECK_GPUS > 0 ? $1 % CHECK_GPUS : 0 )) left rc t0
    local log=$W/logs/check-$i.log
    while [ $k -lt 6 ]; do
        left=$(( STOP_AT - $(date +%s) ))
        [ $left -gt 25 ] || break
        t0=$SECONDS
        CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 \
            timeout -k 5 $(( left + 30 )) $(pin $(( TIMING_SHARDS * TIMING_CORES )) "$CHECK_CORES") \
            python3 benchmarks/coverage.py "${COMMON[@]}" "${CHECK_ARGS[@]}" --stem "check-$i-$k" \
            >>"$log" 2>&1
        rc=$?
        echo "== check $i run $k exit $rc after $(( SECONDS - t0 )) s (at $SECONDS s)" >>"$log"
        [ $rc -eq 0 ] && break
        [ $(( SECONDS - t0 )) -lt 20 ] && [ $rc -ne 3 ] && break   # fails at start: no loop
        k=$(( k + 1 ))
    done
}

time_shard() {   # j: one timing process, alone on its GPU and cores
    local j=$1 gpu=$(( NGPU - TIMING_SHARDS + $1 )) log=$W/logs/timing-$1.log
    local every=(); [ "$TIMING_EVERY_SIZE" = 1 ] && every=(--timing-every-size)
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$TIMING_CORES TORCHINDUCTOR_COMPILE_THREADS=$TIMING_CORES \
        timeout -k 5 $(( STOP_AT - $(date +%s) + 30 )) $(pin $(( j * TIMING_CORES )) "$TIMING_CORES") \
        python3 benchmarks/coverage.py "${COMMON[@]}" --no-checks --timing --timing-shard "$j/$TIMING_SHARDS" \
        "${every[@]}" --timing-limit-s "${TIMING_LIMIT_S:-300}" --stem "timing-$j" >"$log" 2>&1
    echo "== timing $j exit $? at $SECONDS s" >>"$log"
}

pids=()
for (( j = 0; j < TIMING_SHARDS; j++ )); do time_shard "$j" & pids+=($!); done
for (( i = 0; i < SHARDS; i++ )); do check_shard "$i" & pids+=($!); done
wait "${pids[@]}"
echo "== all processes done at $SECONDS s; merging"

shopt -s nullglob
shards=("$W"/json/*.json)
how="${RESUME:+RESUME=$RESUME }bash benchmarks/coverage_gpu.sh $BUDGET_S ($SHARDS checking processes"
how+=" on $CHECK_GPUS GPU(s), $TIMING_SHARDS timing on GPUs of their own)"
COVERAGE_COMMAND=$how python3 benchmarks/coverage.py --merge ${RESUME:+"$RESUME"} "${shards[@]}" --claim-dir "$W/claims" \
    --device "$DEVICE" --out "$OUT" >"$W/logs/merge.log" 2>&1
merge_rc=$?
tar czf "$OUT/logs.tgz" -C "$W" logs json claims
{
    echo "================ coverage_gpu summary ($SECONDS s, merge exit $merge_rc) ================"
    echo "processes: $SHARDS checking, $TIMING_SHARDS timing; families claimed: $(ls "$W/claims" | wc -l)"
    echo "checking process runs by exit code (3: CUDA context broken, 124/137: killed at the deadline):"
    grep -h -o '^== check .* exit [0-9]*' "$W"/logs/check-*.log | grep -o 'exit [0-9]*' | sort | uniq -c
    echo "rows written: $(grep -h -c -E '^\S+ +(sites|excluded|CRASH)' "$W"/logs/check-*.log \
        | awk '{ n += $1 } END { print n }')"
    grep -h -E 'CUDA context broken|^[A-Za-z.]*Error' "$W"/logs/check-*.log 2>/dev/null \
        | cut -c1-200 | sort | uniq -c | sort -rn | head -10
    for f in "$W"/logs/timing-*.log; do
        echo "[$(basename "$f")]"; grep -h -E "^\{'family'|^== timing" "$f" | cut -c1-400
    done
    md=$(ls "$OUT"/coverage-*.md 2>/dev/null | head -1)
    if [ -n "$md" ]; then
        echo "[$md]"
        sed -n '/^## Summary/,/^## Families checked/p' "$md" | head -c 9000
    else
        tail -20 "$W/logs/merge.log"
    fi
} >"$OUT/summary.log" 2>&1
cat "$OUT/summary.log"
rm -rf "$W"
