#!/usr/bin/env bash
# Nsight Compute on the Hopper backward's main kernel, one launch per case, then a side-by-side summary
# (benchmarks/ncu_summary.py). The forward's sibling is benchmarks/ncu_cases.sh.
#
#     CASES="noop causal" HEAD_DIMS="64 128" SEQLEN=4096 bash benchmarks/ncu_bwd_cases.sh
#     CASES="d64:noop d64:causal d128:noop" bash benchmarks/ncu_bwd_cases.sh     # a head dim per case
#
# A case is a benchmarks/ncu_bwd_case.py --case name, crossed with HEAD_DIMS, or "d<D>:<case>" for one head dim
# ("d192:noop" takes V's 128). Clocks are left as the card has them (--clock-control none). Each case is first planned
# on the CPU (ncu_bwd_case.py --dry-run), which names the main kernel the host picks (fa3_bwd_sm90_kernel,
# fa3_bwd_sm90_m128_kernel or fa3_bwd_sm90_wide_kernel) for an exact --kernel-name; the main kernel runs once
# checked against float64 and twice more, and the last launch is profiled. Writes $OUT/ncu-bwd-d<D>-<case>.ncu-rep,
# $OUT/ncu-bwd-summary.log and $OUT/ncu-bwd-metrics.txt (every scalar metric of every report).
# EXTRA="--schedule m128" or EXTRA="--set num_stages=3" passes to every case.
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ncu_common.sh"
CASES=${CASES:-"noop causal"}
HEAD_DIMS=${HEAD_DIMS:-64}
SEQLEN=${SEQLEN:-4096}
SET=${SET:-full}
LOG=$OUT/ncu-bwd-summary.log
ncu_header "$LOG"
echo "CASES=$CASES HEAD_DIMS=$HEAD_DIMS SEQLEN=$SEQLEN SET=$SET EXTRA=$EXTRA" | tee -a "$LOG"
runs=()
for c in $CASES; do
    if [[ $c == d*:* ]]; then runs+=("${c%%:*}:${c#*:}"); else for d in $HEAD_DIMS; do runs+=("d$d:$c"); done; fi
done
reps=()
for r in "${runs[@]}"; do
    d=${r%%:*}; d=${d#d}; c=${r#*:}
    dims=(--head-dim "$d")
    [[ $d == 192 ]] && dims+=(--value-head-dim 128)
    args=(--case "$c" --seqlen "$SEQLEN" "${dims[@]}" $EXTRA)
    plan=$(python3 benchmarks/ncu_bwd_case.py "${args[@]}" --dry-run 2>&1 | tail -1)
    echo "$plan" | tee -a "$LOG"
    kernel=$(echo "$plan" | sed -n 's/.*main kernel \([A-Za-z0-9_]*\) .*/\1/p')
    if [[ -z $kernel ]]; then echo "d$d $c: no plan, skipped" | tee -a "$LOG"; continue; fi
    rep=$OUT/ncu-bwd-d$d-$c
    start=$SECONDS
    # ncu's own lines are dropped but the one with the replay count ("... 100% - N passes")
    "$NCU" --clock-control none --kernel-name "$kernel" --launch-skip 2 --launch-count 1 --set "$SET" \
        --import-source no -f -o "$rep" \
        python3 benchmarks/ncu_bwd_case.py "${args[@]}" --iters 2 2>&1 \
        | grep -v -E '^==PROF== (Connected|Disconnected|Report|Creating)' | tail -6 | tee -a "$LOG"
    echo "d$d $c: $((SECONDS - start)) s under ncu" | tee -a "$LOG"
    [[ -f $rep.ncu-rep ]] && reps+=("$rep.ncu-rep")
done
[[ ${#reps[@]} -gt 0 ]] && PYTHONPATH=$EXTRAS:$PYTHONPATH python3 benchmarks/ncu_summary.py "${reps[@]}" --roles \
    --all-metrics "$OUT/ncu-bwd-metrics.txt" 2>&1 | tee -a "$LOG"
ls -la "$OUT"
