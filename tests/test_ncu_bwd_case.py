"""CPU: benchmarks/ncu_bwd_case.py plans the backward's launches as the product does (no GPU: its dry run). It runs
only on an H200 otherwise, where a rotten script costs a device call."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name):
    """benchmarks/<name>.py, imported once (registered before it runs: its dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the pattern benchmarks/ncu_bwd_cases.sh reads the name with (sed 's/.*main kernel \([A-Za-z0-9_]*\) .*/\1/p')
SHELL_KERNEL = re.compile(r".*main kernel ([A-Za-z0-9_]*) .*")


def test_dry_run_plans_the_hosts_main_kernel(capsys, monkeypatch):
    case = _module("ncu_bwd_case")
    small = dict(seqlen=512, tokens=1024, heads=2, device="cpu")
    # the host's own pick: 64-row steps for noop, the persistent schedule under a mask, 128 rows for ALiBi at D64
    noop = case.plan_case("noop", head_dim=64, **small)
    assert noop.main_kernel_name == "fa3_bwd_sm90_kernel" and noop.main[3] == (4, 4) and noop.forward is None
    assert not noop.main[2]["SCHED"].PERSISTENT and noop.main[2]["SCHED"].OVERLAP == 0
    assert case.plan_case("causal", head_dim=64, **small).main[2]["SCHED"].PERSISTENT
    assert case.plan_case("alibi", head_dim=64, **small).main_kernel_name == "fa3_bwd_sm90_m128_kernel"
    assert case.plan_case("noop", head_dim=128, **small).main[2]["SCHED"].OVERLAP == 2
    # a named schedule and field overrides over that row
    assert case.plan_case("noop", head_dim=64, schedule="m128", **small).main_kernel_name == "fa3_bwd_sm90_m128_kernel"
    staged = case.plan_case("noop", head_dim=64, overrides=case.parse_overrides(["num_stages=3"]), **small)
    assert staged.main[2]["TILE"].NUM_STAGES == 3
    # the CLI's dry run prints the line the shell script takes the exact kernel filter from
    monkeypatch.setattr(sys, "argv", ["ncu_bwd_case.py", "--case", "document", "--head-dim", "192",
                                      "--value-head-dim", "128", "--seqlen", "512", "--tokens", "1024", "--dry-run"])
    case.main()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("document S512 D192/128: main kernel ")
    assert SHELL_KERNEL.fullmatch(line).group(1) == "fa3_bwd_sm90_wide_kernel"


def test_unknown_case_or_schedule_is_refused_before_any_work():
    case = _module("ncu_bwd_case")
    with pytest.raises(SystemExit):
        case.plan_case("window", 512, device="cpu", tokens=1024, heads=2)
    with pytest.raises(ValueError):
        case.parse_overrides(["num_stages=two"])
