"""benchmarks/host_overhead.py's last parts (memo_steps, backward_steps, layer_steps) run to the end on the
CPU with the H200's launch-cache hits emulated (benchmarks/sm90_emulation.py): its GPU run once crashed in
memo_steps (closure introspection of the memo's launch) after the earlier parts had spent the GPU time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "host_overhead.py"


def test_cpu_smoke_runs_memo_backward_and_layer_steps():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("TORCH_LOGS", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert out.rstrip().endswith("cpu smoke: ok"), out[-3000:]
    # the memo's steps replayed the emulated Hopper launch; both backward families and the layer rows ran
    assert "fast_launch.relaunch [hopper]" in out and "C launcher alone" in out, out
    assert "(hopper_bwd), hit" in out and "(generic_bwd), hit" in out, out
    assert out.count("ops as a training step") == 2, out
