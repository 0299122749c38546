#!/usr/bin/env bash
# Nsight Compute on the sm90 kernel, one launch per case, then a side-by-side summary (benchmarks/ncu_summary.py).
#
#     CASES="noop softcap window window-blocks" SEQLEN=8192 bash benchmarks/ncu_cases.sh
#
# Clocks are left as the card has them (--clock-control none). Writes $OUT/ncu-<case>.ncu-rep,
# $OUT/ncu-summary.log and $OUT/ncu-metrics.txt (every scalar metric of every report).
# EXTRA="--set num_stages=3" passes Sm90Config overrides to every case (benchmarks/ncu_case.py).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ncu_common.sh"
CASES=${CASES:-"noop softcap window window-blocks"}
SEQLEN=${SEQLEN:-8192}
SET=${SET:-full}
ncu_header "$OUT/ncu-summary.log"
reps=()
for c in $CASES; do
    # warm-up launches compile the kernel (and fill triton's cache); the last launch is profiled
    "$NCU" --clock-control none --kernel-name regex:fa3_fwd --launch-skip 2 --launch-count 1 --set "$SET" \
        --import-source no -f -o "$OUT/ncu-$c" \
        python3 benchmarks/ncu_case.py --case "$c" --seqlen "$SEQLEN" --iters 2 $EXTRA 2>&1 \
        | grep -v '^==PROF==' | tail -5 | tee -a "$OUT/ncu-summary.log"
    reps+=("$OUT/ncu-$c.ncu-rep")
done
PYTHONPATH=$EXTRAS:$PYTHONPATH python3 benchmarks/ncu_summary.py "${reps[@]}" --all-metrics "$OUT/ncu-metrics.txt" \
    2>&1 | tee -a "$OUT/ncu-summary.log"
ls -la "$OUT"
