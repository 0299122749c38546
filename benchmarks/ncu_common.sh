# Sourced by benchmarks/ncu_cases.sh (forward) and ncu_bwd_cases.sh (backward): the repository as the working
# directory and on PYTHONPATH, $OUT, $NCU, $EXTRAS (Nsight Compute's Python report module, for ncu_summary.py), and
# ncu_header LOG, which starts LOG with the sources' hash, the card, ncu, torch and triton.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# ncu on the PATH may be a wrapper: find the Python report module beside the real install
EXTRAS=$(dirname "$(find / -name ncu_report.py -path "*extras/python*" 2>/dev/null | head -1)")

ncu_header() {
    {
        echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) sources $(find fa3_inductor -name '*.py' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)"
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
        "$NCU" --version | tail -1
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    } 2>&1 | tee "$1"
}
