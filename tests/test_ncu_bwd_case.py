"""CPU: benchmarks/ncu_bwd_case.py plans the backward's launches as the product does (no GPU: the dry run that
benchmarks/ncu_bwd_cases.sh reads the kernel name from), and benchmarks/ncu_summary.py splits a warp-specialized
kernel's code into roles at its setmaxnreg instructions. Both run only on an H200 otherwise, where a rotten script
costs a device call."""
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
    # the host's own pick: 64-row steps for noop and ALiBi, the persistent schedule under a mask, P in registers
    noop = case.plan_case("noop", head_dim=64, **small)
    assert noop.main_kernel_name == "fa3_bwd_sm90_kernel" and noop.main[3] == (4, 4) and noop.forward is None
    assert not noop.main[2]["SCHED"].PERSISTENT and noop.main[2]["SCHED"].OVERLAP == 0
    assert case.plan_case("causal", head_dim=64, **small).main[2]["SCHED"].PERSISTENT
    assert case.plan_case("alibi", head_dim=64, **small).main_kernel_name == "fa3_bwd_sm90_kernel"
    d128 = case.plan_case("noop", head_dim=128, **small).main[2]["SCHED"]
    assert d128.OVERLAP == 2 and d128.P_REGS and not d128.P_CARRY16
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


# triton 3.6's layout of a warp-specialized kernel (fa3_bwd_sm90_kernel, D64): the role dispatch, warpgroup 1 (a
# worker partition, 240 registers), the idle warps' parking, the producer (24, TMA loads), warpgroup 0 (the default
# partition) after its setup at 256
TRITON_LAYOUT = [
    (0x000, "S2R R2, SR_TID.X"), (0x070, "@!P0 BRA 0x4720"), (0x180, "USETMAXREG.DEALLOC.CTAPOOL 0x78"),
    (0x280, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0"), (0x16a0, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
    (0x3bb0, "USETMAXREG.DEALLOC.CTAPOOL 0x78"), (0x3bd0, "NOP"), (0x3d00, "USETMAXREG.DEALLOC.CTAPOOL 0x18"),
    (0x4240, "UTMALDG.4D [UR8], [UR4]"), (0x4730, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x100"),
    (0x4a70, "USETMAXREG.DEALLOC.CTAPOOL 0xf0"), (0x5dc0, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
    (0x7780, "@UP3 UTMAREDG.3D.ADD [UR32], [UR8]"),
]


def test_roles_split_at_setmaxnreg():
    summary = _module("ncu_summary")
    regions = summary.code_regions(TRITON_LAYOUT)
    assert regions == [(0x0, None, "other"), (0x180, 120, "other"), (0x280, 240, "consumer"),
                       (0x3bb0, 120, "other"), (0x3d00, 24, "producer"), (0x4730, 256, "other"),
                       (0x4a70, 240, "consumer")]
    # the idle warps' barrier at the NOP, the producer's mbarrier poll, both consumers' wgmma waits
    samples = {"barrier": {0x3bd0: 25, 0x16b0: 7, 0x5dd0: 8}, "long_scoreboard": {0x4250: 6}}
    assert summary.samples_by_region(regions, samples) == {2: {"barrier": 7}, 3: {"barrier": 25},
                                                           4: {"long_scoreboard": 6}, 6: {"barrier": 8}}


def test_kernel_instructions_walk_down_to_the_entry():
    summary = _module("ncu_summary")
    base = 0x7F0000001000
    code = {base + 16 * i: f"I{i}" for i in range(40)}

    def sass_at(pc):
        if pc not in code:
            raise KeyError(pc)   # an address outside the kernel
        return code[pc]

    got = summary.kernel_instructions(sass_at, [base + 16 * 30, base + 16 * 12])
    assert got[0] == (base, "I0") and got[-1] == (base + 16 * 30, "I30") and len(got) == 31


@pytest.mark.sm90_compile
def test_roles_of_the_compiled_d64_kernel():
    """The split on the real SASS: two consumer regions (the step loops' wgmma) and one producer."""
    import torch

    from fa3_inductor.templates.aot import sass_report
    from fa3_inductor.templates.hopper_bwd import compile_hopper_backward

    summary = _module("ncu_summary")
    q = torch.randn(1, 2, 512, 64, dtype=torch.bfloat16)
    _, main, _ = compile_hopper_backward(q, q, q, torch.empty_like(q), torch.empty_like(q), torch.empty(1, 2, 512),
                                         sm_scale=0.125)
    code = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);",
                                                           sass_report(main).sass)]
    roles = [role for _, regs, role in summary.code_regions(code) if role != "other"]
    assert roles == ["consumer", "producer", "consumer"], summary.code_regions(code)
