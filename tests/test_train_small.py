"""benchmarks/train_small.py --smoke on the CPU: the training harness runs end to end under Triton's
interpreter, writes its files, and fa3's losses follow eager's (float32, so closely)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "train_small.py"
LOSS_TOL = 1e-3   # float32 on both sides: only summation order differs (loose on purpose)


def _module():
    """The script as a module (registered first: its dataclasses look their module up)."""
    if "train_small" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_small", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_small"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_small"]


def test_smoke_run_writes_results_and_fa3_tracks_eager(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("TORCH_LOGS", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--impls", "eager,fa3",
                          "--steps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [json_path] = tmp_path.glob("train-small-*.json")
    [md_path] = tmp_path.glob("train-small-*.md")
    result = json.loads(json_path.read_text())
    assert {"device", "torch", "triton", "date", "model", "train", "corpus", "rows"} <= set(result)
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "fa3"} and all(r["status"] == "ok" for r in rows.values()), rows
    eager, fa3 = rows["eager"]["losses"], rows["fa3"]["losses"]
    assert len(eager) == len(fa3) == 2 and eager[-1] < math.log(256) + 0.1
    assert max(abs(a - b) for a, b in zip(fa3, eager)) < LOSS_TOL, (fa3, eager)
    assert rows["fa3"]["vs_eager"]["agrees"], rows["fa3"]["vs_eager"]
    sites = rows["fa3"]["fa3_sites"]   # every layer's attention on our forward and our backward
    assert sites["rewritten"] == result["model"]["layers"] and sites["ours"], sites
    assert rows["fa3"]["dynamo"]["graph_breaks"] == 0, rows["fa3"]["dynamo"]
    table = md_path.read_text()
    assert "| fa3 | flex |" in table and "all ours (forward and backward): yes" in table
    assert run.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])   # the table comes last
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert bool(list(tmp_path.glob("train-small-*.png"))) == has_plot or "no plot" in run.stdout
    # a CUDA run's --profile-steps section, rendered from a row that carries one
    spec = importlib.util.spec_from_file_location("train_small", SCRIPT)
    train_small = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train_small   # dataclasses look their module up by name
    spec.loader.exec_module(train_small)
    rows["fa3"]["profile"] = {"steps": 5, "wall_ms_per_step": 9.5, "gpu_ms_per_step": 8.25,
                              "syncs_per_step": {"x.py:3": 2},
                              "gc_per_step": {"collections": 1.5, "ms": 0.25, "oldest_generation": 2},
                              "kernels": [{"name": "fa3_bwd_sm90_kernel", "ms_per_step": 2.5, "launches_per_step": 8}]}
    table = train_small.markdown(result)
    assert "fa3: kernels per step (torch.profiler over 5 steps after the run): GPU 8.25 ms, host wall 9.50 ms, " \
        in table and "| `fa3_bwd_sm90_kernel` | 2.500 | 8 |" in table and "x.py:3 ×2" in table
    assert "fa3: Python garbage collection per step: 1.5 collections, 0.25 ms (oldest generation 2)" in table


def test_agreement_flags_drift_and_nan():
    ts = _module()
    crit = ts.Agreement(mean_abs=0.05, mean_signed=0.02)
    ref = [5.0 - 0.01 * i for i in range(200)]
    noisy = [x + (0.01 if i % 2 else -0.01) for i, x in enumerate(ref)]
    assert ts.agreement(noisy, ref, crit)["agrees"]
    drifted = [x + 0.03 for x in ref]           # one curve above the other throughout
    verdict = ts.agreement(drifted, ref, crit)
    assert not verdict["agrees"] and abs(verdict["mean_last"] - 0.03) < 1e-9 and verdict["window"] == 100
    assert not ts.agreement(ref[:-1] + [float("nan")], ref, crit)["agrees"]


def test_fa3_sites_not_ours_when_a_fallback_serves():
    ts = _module()
    recognized = [{"front_door": "flex_attention", "node": f"n{i}", "rewritten": True, "site_id": i}
                  for i in (1, 2)]
    recognized.append({"front_door": "sdpa", "node": "s", "rewritten": False, "reason": "small"})
    lowered = [{"template": "hopper", "site_id": 1}, {"template": "hopper", "site_id": 2}]
    backward = [{"family": "hopper_bwd", "kernel": "fa3_inductor.flex_bwd", "site_id": 1},
                {"family": "torch", "kernel": "torch", "site_id": 2, "reason": "no family serves it"}]
    summary = ts.fa3_sites(recognized, lowered, backward)
    assert summary["forward"] == {"hopper": 2} and summary["backward"] == {"hopper_bwd": 1, "torch": 1}
    assert summary["forward_ours"] and not summary["backward_ours"] and not summary["ours"]
    assert summary["left_alone"] == ["sdpa s: small"]
