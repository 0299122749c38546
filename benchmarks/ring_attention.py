"""Context-parallel attention (fa3_inductor.distributed.ring_flex): speed per GPU, memory, balance.

Modes:

    # 2 or 4 GPUs of one host (NCCL): ours (ring, all-gather), our single-GPU figure and torch's
    # context-parallel SDPA in one run; results (.json, .md) written to --out after every size
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/ring_attention.py dist \
        --per-gpu 131072 65536 --check-per-gpu 65536 --budget-s 170 --out benchmarks/results
    # the same on the CPU (gloo, tiny sizes, dense kernel): shakes out the script itself
    torchrun --nproc-per-node 2 benchmarks/ring_attention.py dist --device cpu --per-gpu 64 128 \
        --heads 2 --head-dim 16 --out /tmp/ring
    # what a dist run will take (model: --assume-tflops per GPU), no GPU needed
    python benchmarks/ring_attention.py plan --world 2 4 --per-gpu 65536 131072
    # one GPU: every "rank" of an n-rank ring in one process (per-shard forward and backward
    # speed, overlap); --device cpu --kernel dense runs it on the CPU
    python benchmarks/ring_attention.py emulate --world 4 --per-gpu 32768
    # CPU: work each rank of a layout gets (visited 128x128 tiles per rank and per ring step)
    python benchmarks/ring_attention.py balance --world 4 --total 131072

``dist`` (B --batch, H --heads, Hkv --kv-heads, D --head-dim, --dtype, --mask): T = n x per-GPU
length S. Implementations, each in its own try (a failure is recorded in its row, never stops
the run): ``single`` (``fa3_inductor.flex`` on one GPU at length S, same mask kind: the
reference for the issue's ring ÷ single ≥ 0.9), ``ring`` and ``allgather`` (``ring_flex``),
``torch_cp_<backend>`` (SDPA inside torch's ``context_parallel``, head-tail sharding like ours;
causal only; K/V heads expanded for GQA). FP8 rows (inference, forward only; opt-in with
``--impls ... single_fp8 ring_fp8 allgather_fp8``): ``single_fp8`` (``flex(fp8=True)`` at length
S), ``ring_fp8`` / ``allgather_fp8`` (``ring_flex(fp8=True)``: each step through the FP8 prologue
and kernel); their ratios are ÷ ``single_fp8``, and the check adds ring / all-gather FP8 against
``flex(fp8=True)`` on the whole sequence (tolerance 1e-1: FP8's, tests/reference.py). Per
implementation: forward (no grad) and forward + backward. Times: median of --reps wall-clock
calls between device synchronizations, every rank barrier'd first, the slowest rank's median;
the first call (compiles) is timed apart. TFLOP/s per GPU = FLOPs of the whole attention / n /
time, FLOPs = 4 B H D x visible (q, k) pairs (causal: T²/2); forward + backward = 3.5 x forward.
Peak memory: max_memory_allocated during forward + backward (FP8 rows: forward), per GPU (inputs
included). A correctness check
first (--check-per-gpu): ring and all-gather against our kernel on the whole sequence.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set before the process group starts. --budget-s bounds the run: a size
whose predicted time does not fit is skipped (rows say so), as are the remaining implementations
of a size once over budget.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script (torchrun): import the package from this checkout
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import commit_label  # noqa: E402

# Must hold before any NCCL / symmetric-memory initialization: NVLink multicast stays off.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

# In run order: once over --budget-s the rest of a size is skipped, so the must-shows
# (ring against single and against torch's CP SDPA) come first.
IMPLS = ("single", "ring", "torch_cp_cudnn", "torch_cp_flash", "allgather")
# FP8 (inference, forward only), opt-in: --impls ... single_fp8 ring_fp8 allgather_fp8
FP8_IMPLS = ("single_fp8", "ring_fp8", "allgather_fp8")
FP8_TOLERANCE = 1e-1   # tests/reference.py's FP8_TOLERANCE: P's e4m3 rounding stays in the output
TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
SETTINGS = ("per_gpu", "batch", "heads", "kv_heads", "head_dim", "dtype", "mask", "kernel", "impls",
            "reps", "check_per_gpu", "budget_s")     # the .md's settings line
WINDOW = 4096          # --mask window
DOCUMENTS = 8          # --mask document: equal documents per sequence


def set_no_multicast_env() -> dict[str, Optional[str]]:
    """Force NVLink multicast off (module docstring); returns the values found before.

    Example::

        >>> set_no_multicast_env()["NCCL_NVLS_ENABLE"] in (None, "0", "1")
        True
    """
    before = {name: os.environ.get(name) for name in NO_MULTICAST}
    os.environ.update(NO_MULTICAST)
    return before


# ---------------------------------------------------------------- masks and FLOPs

def make_mask(name: str, total: int, device: Any) -> Callable:
    """The mask_mod of ``--mask name`` over ``total`` global positions.

    Example::

        >>> make_mask("causal", 8, "cpu")(0, 0, 3, 2)
        True
    """
    from fa3_inductor import mods

    if name == "causal":
        return mods.causal
    if name == "window":
        return mods.sliding_window(WINDOW)
    import torch

    doc = torch.arange(total, device=device) // max(total // DOCUMENTS, 1)
    return mods.document(doc)


def visible_pairs(mask: str, total: int) -> float:
    """Visible (query, key) pairs of ``mask`` over ``total`` tokens (causal counted as T²/2,
    the convention of FLOP counts; window and document likewise at their exact density).

    Example::

        >>> visible_pairs("causal", 4), visible_pairs("window", 8192)
        (8.0, 25165824.0)
    """
    if mask == "causal":
        return total * total / 2
    if mask == "window":
        w = min(WINDOW, total)
        return float(total * w - w * w / 2)
    doc = max(total // DOCUMENTS, 1)
    return float((total // doc) * doc * doc / 2)


def attention_flops(batch: int, heads: int, head_dim: int, mask: str, total: int) -> float:
    """Forward FLOPs: 4 B H D x visible pairs (two matmuls).

    Example::

        >>> attention_flops(1, 16, 128, "causal", 1024)
        4294967296.0
    """
    return 4.0 * batch * heads * head_dim * visible_pairs(mask, total)


# ---------------------------------------------------------------- distributed helpers

class Comm:
    """The process group's rank, size and the device its collectives use (None: one process)."""

    def __init__(self, device: Any) -> None:
        import torch
        import torch.distributed as dist

        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.device = torch.device(device)
        self._mesh = None

    def mesh(self):
        """A 1-D DeviceMesh over every rank (made once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.on:
            dist.barrier()

    def max(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        import torch
        import torch.distributed as dist

        if not self.on:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` holds on some rank (keeps decisions collective)."""
        return self.max(1.0 if flag else 0.0) > 0.0

    def gather(self, obj: Any) -> list:
        """``obj`` of every rank, in rank order, on every rank."""
        import torch.distributed as dist

        if not self.on:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait_for_variants() -> None:
    try:
        from fa3_inductor.runtime.variants import wait_for_variants

        wait_for_variants()
    except Exception:   # an internal helper: timing goes on without it
        pass


def time_call(comm: Comm, fn: Callable[[], Any], reps: int, max_s: float) -> dict:
    """First call (compiles) and the median of up to ``reps`` more, each between device
    synchronizations with every rank barrier'd first; the slowest rank's figures. Stops early
    (on every rank) once the timed calls pass ``max_s``.

    Example::

        >>> time_call(Comm("cpu"), lambda: sum(range(100)), reps=3, max_s=10.0)["reps"]
        3
    """
    comm.barrier()
    _sync(comm.device)
    t0 = time.perf_counter()
    fn()
    _sync(comm.device)
    first = time.perf_counter() - t0
    _wait_for_variants()
    times: list[float] = []
    spent = 0.0
    for _ in range(reps):
        comm.barrier()
        _sync(comm.device)
        t0 = time.perf_counter()
        fn()
        _sync(comm.device)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
        if len(times) < reps and comm.any(spent > max_s):
            break
    return {"ms": comm.max(statistics.median(times) * 1e3), "first_s": comm.max(first),
            "reps": len(times)}


# ---------------------------------------------------------------- one implementation

def _rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class Case:
    """One per-GPU length: inputs, masks, FLOPs, and how each implementation runs on them."""

    def __init__(self, args, comm: Comm, per_gpu: int) -> None:
        import torch

        from fa3_inductor.distributed import SeqLayout

        self.args, self.comm, self.per_gpu = args, comm, per_gpu
        self.total = per_gpu * comm.world
        dev, dtype = comm.device, _dtype(args.dtype)
        gen = torch.Generator(device=dev).manual_seed(1234 + comm.rank)
        shape = (args.batch, args.heads, per_gpu, args.head_dim)
        kv_shape = (args.batch, args.kv_heads, per_gpu, args.head_dim)
        self.q, self.k, self.v, self.dout = (
            torch.randn(s, generator=gen, device=dev, dtype=dtype)
            for s in (shape, kv_shape, kv_shape, shape))
        self.gqa = args.kv_heads != args.heads
        self.layout = SeqLayout(comm.world)
        self.mask = make_mask(args.mask, self.total, dev)
        self.single_mask = make_mask(args.mask, per_gpu, dev)
        self.flops = attention_flops(args.batch, args.heads, args.head_dim, args.mask, self.total)
        self.single_flops = attention_flops(args.batch, args.heads, args.head_dim, args.mask,
                                            per_gpu)

    def row(self, impl: str) -> dict:
        return {"world": self.comm.world, "per_gpu": self.per_gpu, "total": self.total,
                "impl": impl, "mask": self.args.mask, "batch": self.args.batch,
                "heads": self.args.heads, "kv_heads": self.args.kv_heads,
                "head_dim": self.args.head_dim, "dtype": self.args.dtype, "status": "ok"}

    def forward_and_step(self, impl: str) -> tuple[Callable, Optional[Callable], Callable]:
        """(forward, forward + backward, cleanup) callables of ``impl``; FP8 impls (inference)
        have no forward + backward (None)."""
        import torch

        from fa3_inductor.distributed import ring_flex

        leaves = [t.detach().requires_grad_() for t in (self.q, self.k, self.v)]
        kernel = self.args.kernel

        if impl in FP8_IMPLS:
            if kernel == "dense":
                raise NotImplementedError("not run: FP8 runs on our kernels (--kernel fa3)")
            if impl == "single_fp8":
                def attend(q, k, v):
                    return single_attention(q, k, v, self.single_mask, self.gqa, kernel, fp8=True)
            else:
                method = impl[:-len("_fp8")]

                def attend(q, k, v):
                    return ring_flex(q, k, v, mask_mod=self.mask, layout=self.layout,
                                     enable_gqa=self.gqa, method=method, kernel=kernel, fp8=True)
            forward, _, close = self._closures(attend, leaves, lambda: None)
            return forward, None, close
        if impl == "single":
            def attend(q, k, v):
                return single_attention(q, k, v, self.single_mask, self.gqa, kernel)
        elif impl in ("ring", "allgather"):
            def attend(q, k, v):
                return ring_flex(q, k, v, mask_mod=self.mask, layout=self.layout,
                                 enable_gqa=self.gqa, method=impl, kernel=kernel)
        else:
            return self._torch_cp(impl[len("torch_cp_"):], leaves)
        return self._closures(attend, leaves, lambda: None)

    def _closures(self, attend: Callable, leaves: list, close: Callable
                  ) -> tuple[Callable, Callable, Callable]:
        """(forward without grad, forward + backward, close) around one attention callable."""
        import torch

        def forward():
            with torch.no_grad():
                return attend(self.q, self.k, self.v)

        def step():
            attend(*leaves).backward(self.dout)
            for t in leaves:
                t.grad = None
        return forward, step, close

    def _torch_cp(self, backend: str, leaves: list) -> tuple[Callable, Callable, Callable]:
        """torch's context_parallel SDPA on this rank's head-tail shards (already laid out like
        torch's load balancer: tests/test_ring_attention.py::test_layout_matches_torch_head_tail).
        The context shards a small (1, 1, T, 1) stand-in buffer only: torch's in-place sharding
        of full-length q/k/v would leave their full storage allocated and inflate peak memory."""
        import torch
        import torch.nn.functional as F
        from torch.distributed.tensor.experimental import context_parallel as torch_cp
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if self.args.mask != "causal":
            raise NotImplementedError("not run: torch's context-parallel SDPA serves is_causal "
                                      "only (no mask_mod)")
        if backend not in TORCH_BACKENDS:
            raise ValueError(f"unknown SDPA backend {backend!r}; one of {sorted(TORCH_BACKENDS)}")
        chosen = getattr(SDPBackend, TORCH_BACKENDS[backend])
        stand_in = torch.zeros(1, 1, self.total, 1, device=self.comm.device, dtype=self.q.dtype)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch_cp(self.comm.mesh(), buffers=[stand_in],
                                         buffer_seq_dims=[2], no_restore_buffers={stand_in}))
            stack.enter_context(sdpa_kernel([chosen]))
        except BaseException:
            stack.close()   # torch's context restores F.scaled_dot_product_attention
            raise
        groups = self.args.heads // self.args.kv_heads

        def attend(q, k, v):
            if groups > 1:   # torch's CP ring takes equal heads: expand K/V (counted in its time)
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return self._closures(attend, leaves, stack.close)


def single_attention(q, k, v, mask_mod: Callable, gqa: bool, kernel: str, fp8: bool = False):
    """Our attention on one device, no communication: ``fa3_inductor.flex`` (kernel "fa3"; with
    ``fp8``, its FP8 path) or the dense shard kernel the CPU ring uses (kernel "dense").

    Example::

        >>> import torch; from fa3_inductor import mods
        >>> q = torch.randn(1, 2, 64, 16)
        >>> single_attention(q, q, q, mods.causal, False, "dense").shape
        torch.Size([1, 2, 64, 16])
    """
    import torch

    if kernel == "dense":
        from fa3_inductor.distributed.shard_attention import ShardMods, shard_attention

        n = q.shape[2]
        zero = torch.zeros(4, dtype=torch.int32, device=q.device)
        return shard_attention(q, k, v, ShardMods(None, mask_mod, zero, n, k.shape[2]),
                               q.shape[-1] ** -0.5, gqa, "dense")[0]
    import fa3_inductor
    from fa3_inductor.block_masks import cached_block_mask

    # the ring's bounded-memory block mask: an eager create_block_mask at 128k needs 32 GiB
    return fa3_inductor.flex(q, k, v, block_mask=cached_block_mask(mask_mod, q, k),
                             enable_gqa=gqa, fp8=True if fp8 else None)


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _memory_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _memory_peak_gib(device) -> Optional[float]:
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _free(device, collect: bool = False) -> None:
    """Give cached device memory back; ``collect``: first break reference cycles (a caught
    exception's traceback holds the failed call's tensors). Nothing to do on the CPU."""
    import gc

    import torch

    if device.type != "cuda":
        return
    if collect:
        gc.collect()
    torch.cuda.empty_cache()


def measure(case: Case, impl: str, max_s: float) -> dict:
    """Forward and forward + backward of ``impl`` on ``case``: one result row (status "ok", or
    the error as every rank saw it). Collective: every rank calls it with the same arguments.

    Example::

        >>> measure(case, "ring", 30.0)["fwd_tflops"]           # doctest: +SKIP
        412.3
    """
    comm, row = case.comm, case.row(impl)
    error = None
    cleanup = lambda: None  # noqa: E731
    forward_only = impl in FP8_IMPLS   # inference: the peak is the forward's
    try:
        forward, step, cleanup = case.forward_and_step(impl)
        if forward_only:
            _memory_reset(comm.device)
        fwd = time_call(comm, forward, case.args.reps, max_s / 2)
        row.update(fwd_ms=fwd["ms"], fwd_first_s=fwd["first_s"], fwd_reps=fwd["reps"])
        if not impl.startswith("torch_cp"):   # the kernel family our last call ran
            import fa3_inductor

            row["template"] = fa3_inductor.last_template() if case.args.kernel == "fa3" else "dense"
        if step is not None:
            _memory_reset(comm.device)
            both = time_call(comm, step, case.args.reps, max_s / 2)
            row.update(fwdbwd_ms=both["ms"], fwdbwd_first_s=both["first_s"],
                       fwdbwd_reps=both["reps"])
    except Exception as exc:  # recorded in the row; the run goes on
        error = f"{type(exc).__name__}: {exc}".strip()
        if not error.startswith("NotImplementedError: not run"):
            error += "\n" + traceback.format_exc(limit=6)
    finally:
        try:
            cleanup()
        except Exception as exc:
            error = (error or "") + f"\ncleanup: {type(exc).__name__}: {exc}"
    measured = "fwd_ms" in row if forward_only else "fwdbwd_ms" in row
    peaks = comm.gather(_memory_peak_gib(comm.device) if measured else None)
    errors = comm.gather(error)
    _free(comm.device, collect=any(e is not None for e in errors))
    comm.barrier()
    if any(e is not None for e in errors):
        first = next(e for e in errors if e is not None)
        failed = [r for r, e in enumerate(errors) if e is not None]
        reason = first.removeprefix("NotImplementedError: ")
        row["status"] = reason.splitlines()[0] if reason.startswith("not run") else \
            f"error on ranks {failed}: {first.splitlines()[0]}"
        row["error"] = first
    per_gpu_flops = case.flops / comm.world
    if impl in ("single", "single_fp8"):
        per_gpu_flops = case.single_flops
    for key, factor in (("fwd", 1.0), ("fwdbwd", 3.5)):
        if f"{key}_ms" in row:
            row[f"{key}_tflops"] = factor * per_gpu_flops / (row[f"{key}_ms"] * 1e-3) / 1e12
    if any(p is not None for p in peaks):
        row["peak_gib_per_gpu"] = peaks
        row["peak_gib"] = max(p for p in peaks if p is not None)
    return row


def check(args, comm: Comm) -> dict:
    """Ring and all-gather at ``--check-per-gpu`` tokens per rank against our kernel on the whole
    sequence (every rank computes the reference): relative errors of out, lse, dq, dk, dv.

    Example::

        >>> check(args, comm)["status"]                          # doctest: +SKIP
        'ok'
    """
    import torch

    from fa3_inductor.distributed import SeqLayout, ring_flex

    per_gpu = args.check_per_gpu if args.check_per_gpu > 0 else args.per_gpu[0]
    total = per_gpu * comm.world
    dev, dtype = comm.device, _dtype(args.dtype)
    gen = torch.Generator(device=dev).manual_seed(99)
    shape = (args.batch, args.heads, total, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, total, args.head_dim)
    full = [torch.randn(s, generator=gen, device=dev, dtype=dtype)
            for s in (shape, kv_shape, kv_shape, shape)]
    if comm.on:   # the same full sequence on every rank
        import torch.distributed as dist

        for t in full:
            dist.broadcast(t, src=0)
    mask, gqa = make_mask(args.mask, total, dev), args.kv_heads != args.heads
    layout = SeqLayout(comm.world)
    row = {"world": comm.world, "per_gpu": per_gpu, "total": total, "impl": "check",
           "mask": args.mask, "status": "ok"}
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error, errs = None, {}
    try:   # errors and figures are gathered after: the check's own reductions come last
        leaves = [t.detach().requires_grad_() for t in full[:3]]
        if args.kernel == "dense":
            from fa3_inductor.distributed.shard_attention import ShardMods, shard_attention

            zero = torch.zeros(4, dtype=torch.int32, device=dev)
            ref, ref_lse = shard_attention(*leaves, ShardMods(None, mask, zero, total, total),
                                           args.head_dim ** -0.5, gqa, "dense")
        else:
            import fa3_inductor
            from fa3_inductor.block_masks import cached_block_mask

            ref, ref_lse = fa3_inductor.flex(*leaves, block_mask=cached_block_mask(mask, *full[:2]),
                                             enable_gqa=gqa, return_lse=True)
        ref.backward(full[3])
        want = [layout.shard(t, 2, comm.rank) for t in (ref.detach(), ref_lse.detach(),
                                                         *(x.grad for x in leaves))]
        for method in ("ring", "allgather"):
            shards = [layout.shard(t, 2, comm.rank).requires_grad_() for t in full[:3]]
            out, lse = ring_flex(*shards, mask_mod=mask, layout=layout, enable_gqa=gqa,
                                 return_lse=True, method=method, kernel=args.kernel)
            out.backward(layout.shard(full[3], 2, comm.rank))
            got = [out, lse, *(x.grad for x in shards)]
            for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                errs[f"{method}_{name}_rel_err"] = _rel(g, w)
        if args.kernel != "dense" and any(i in FP8_IMPLS for i in args.impls):
            errs.update(_check_fp8(full, mask, gqa, layout, comm, args.kernel))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    errors = comm.gather(error)
    per_rank = comm.gather(errs)
    _free(dev, collect=True)
    if any(e is not None for e in errors):
        row["status"] = "error: " + next(e for e in errors if e is not None).splitlines()[0]
        row["error"] = next(e for e in errors if e is not None)
        return row
    for key in per_rank[0]:
        row[key] = max(r[key] for r in per_rank)
    worst = max(v for k, v in row.items() if k.endswith("_rel_err") and "_fp8_" not in k)
    row["worst_rel_err"] = worst
    if not worst <= tolerance:
        row["status"] = f"MISMATCH: worst relative error {worst:.2e} > {tolerance:.0e}"
    fp8 = [v for k, v in row.items() if k.endswith("_rel_err") and "_fp8_" in k]
    if fp8:
        row["worst_fp8_rel_err"] = max(fp8)
        if not max(fp8) <= FP8_TOLERANCE and row["status"] == "ok":
            row["status"] = (f"MISMATCH: worst FP8 relative error {max(fp8):.2e} > "
                             f"{FP8_TOLERANCE:.0e}")
    return row


def _check_fp8(full: list, mask: Callable, gqa: bool, layout, comm: Comm, kernel: str) -> dict:
    """Ring and all-gather FP8 forwards against ``flex(fp8=True)`` on the whole sequence (out,
    lse relative errors): both quantize per tile and round P to e4m3, each its own way, so they
    agree to FP8's tolerance, not bf16's."""
    import torch

    import fa3_inductor
    from fa3_inductor.block_masks import cached_block_mask
    from fa3_inductor.distributed import ring_flex

    errs = {}
    with torch.no_grad():
        ref, ref_lse = fa3_inductor.flex(*full[:3], block_mask=cached_block_mask(mask, *full[:2]),
                                         enable_gqa=gqa, return_lse=True, fp8=True)
        want = [layout.shard(t, 2, comm.rank) for t in (ref, ref_lse)]
        for method in ("ring", "allgather"):
            shards = [layout.shard(t, 2, comm.rank) for t in full[:3]]
            got = ring_flex(*shards, mask_mod=mask, layout=layout, enable_gqa=gqa,
                            return_lse=True, method=method, kernel=kernel, fp8=True)
            for name, g, w in zip(("out", "lse"), got, want):
                errs[f"{method}_fp8_{name}_rel_err"] = _rel(g, w)
    return errs


# ---------------------------------------------------------------- time model and budget

def estimate_s(world: int, per_gpu: int, args, impls: Optional[list] = None) -> float:
    """Predicted seconds of one size (all implementations, warm-up call + --reps each) at
    --assume-tflops per GPU for every kernel; compiles not included.

    Example::

        >>> a = argparse.Namespace(batch=1, heads=16, head_dim=128, mask="causal", reps=3,
        ...                        assume_tflops=450.0, impls=list(IMPLS))
        >>> round(estimate_s(2, 65536, a), 1)
        6.3
    """
    rate = args.assume_tflops * 1e12
    ring_fwd = attention_flops(args.batch, args.heads, args.head_dim, args.mask,
                               world * per_gpu) / world / rate
    single_fwd = attention_flops(args.batch, args.heads, args.head_dim, args.mask, per_gpu) / rate
    # forward + (forward + backward) per call
    cost = {"single": single_fwd * 4.5, "ring": ring_fwd * 4.5, "allgather": ring_fwd * 4.5,
            "single_fp8": single_fwd, "ring_fp8": ring_fwd, "allgather_fp8": ring_fwd,
            "torch_cp_flash": ring_fwd * 4.5, "torch_cp_cudnn": ring_fwd * 4.5,
            "torch_cp_efficient": ring_fwd * 4.5, "torch_cp_math": ring_fwd * 4.5}
    impls = impls if impls is not None else args.impls
    return (1 + args.reps) * sum(cost.get(i, ring_fwd * 4.5) for i in impls)


def predict_s(rows: list[dict], scale: float) -> float:
    """Seconds the next size will take: the timed calls of ``rows`` (one size's results) times
    ``scale`` (the work ratio), plus their first calls' extra (compiles; not scaled, as the next
    size compiles about as much).

    Example::

        >>> predict_s([{"fwd_ms": 100.0, "fwd_reps": 3, "fwd_first_s": 5.1}], 4.0)
        6.6
    """
    total = 0.0
    for r in rows:
        for key in ("fwd", "fwdbwd"):
            if r.get(f"{key}_ms") is None:
                continue
            call = r[f"{key}_ms"] * 1e-3
            total += call * (1 + r[f"{key}_reps"]) * scale + max(r[f"{key}_first_s"] - call, 0.0)
    return round(total, 3)


def run_plan(args) -> list[dict]:
    """Print the time model of a dist run for each --world and --per-gpu (module docstring)."""
    rows = []
    for world in args.world:
        for per_gpu in args.per_gpu:
            rows.append({"world": world, "per_gpu": per_gpu, "total": world * per_gpu,
                         "estimate_s": round(estimate_s(world, per_gpu, args), 1)})
            print(json.dumps(rows[-1]))
    print(f"total {sum(r['estimate_s'] for r in rows):.0f} s of attention at "
          f"{args.assume_tflops:.0f} TFLOP/s per GPU (startup, compiles, check not included)")
    return rows


# ---------------------------------------------------------------- results

def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def _sources_hash() -> str:
    h = hashlib.sha1()
    for path in sorted((ROOT / "fa3_inductor").rglob("*.py")):
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def environment(args, comm: Comm, env_before: dict) -> dict:
    """Device, versions, date, command and settings a result file records."""
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"torchrun --nproc-per-node {comm.world} " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "world": comm.world, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "sources_sha1": _sources_hash(), "args": vars(args),
        "env_before": env_before,
        "env": {k: os.environ.get(k) for k in (*NO_MULTICAST, "FA3_INDUCTOR_VARIANTS",
                                                "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")},
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    info["git"] = commit_label(str(ROOT))
    if comm.device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(comm.device)
        info["devices"] = comm.gather(torch.cuda.get_device_name(comm.device))
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            info["nccl"] = None
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):   # small figures (CPU runs) keep three significant digits
        return f"{value:.{digits}f}" if abs(value) >= 10 ** (2 - digits) else f"{value:.3g}"
    return str(value)


def table(rows: list[dict]) -> str:
    """The result rows as a markdown table (ratios ÷ the single-GPU figure of the same size).

    Example::

        >>> print(table([{"world": 2, "per_gpu": 8, "total": 16, "impl": "ring", "status": "ok"}]))
        ... # doctest: +ELLIPSIS
        | GPUs | per GPU | total | impl | ...
    """
    single = {(r["world"], r["per_gpu"], r["impl"]): r for r in rows
              if r["impl"] in ("single", "single_fp8")}
    lines = ["| GPUs | per GPU | total | impl | fwd TFLOP/s/GPU | ÷ single | fwd+bwd TFLOP/s/GPU "
             "| ÷ single | fwd ms | fwd+bwd ms | peak GiB (max GPU) | 1st call s | status |",
             "|" + "---|" * 13]
    for r in rows:
        if r["impl"] == "check":
            continue
        base = "single_fp8" if r["impl"] in FP8_IMPLS else "single"   # FP8 ÷ FP8 on one GPU
        ref = single.get((r["world"], r["per_gpu"], base), {})
        ratios = []
        for key in ("fwd_tflops", "fwdbwd_tflops"):
            ok = r.get(key) is not None and ref.get(key) and r["impl"] != base
            ratios.append(f"{r[key] / ref[key]:.2f}" if ok else "-")
        firsts = [r[k] for k in ("fwd_first_s", "fwdbwd_first_s") if r.get(k) is not None]
        status = r["status"] if len(r["status"]) <= 110 else r["status"][:107] + "..."
        lines.append(
            f"| {r['world']} | {r['per_gpu']} | {r['total']} | {r['impl']} "
            f"| {_fmt(r.get('fwd_tflops'), 1)} | {ratios[0]} | {_fmt(r.get('fwdbwd_tflops'), 1)} "
            f"| {ratios[1]} | {_fmt(r.get('fwd_ms'), 2)} | {_fmt(r.get('fwdbwd_ms'), 2)} "
            f"| {_fmt(r.get('peak_gib'), 2)} | {_fmt(max(firsts) if firsts else None, 1)} "
            f"| {status.replace('|', '/')} |")
    return "\n".join(lines)


def write_results(path_stem: Path, env: dict, rows: list[dict], finished: bool) -> None:
    """``<stem>.json`` (everything) and ``<stem>.md`` (header, table, checks, errors)."""
    payload = {"mode": "dist", "finished": finished, **env, "rows": rows}
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    with open(path_stem.with_suffix(".json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    checks = [r for r in rows if r["impl"] == "check"]
    errors = [r for r in rows if r.get("error") and not r["status"].startswith("not run")]
    md = [f"# ring attention, {env['world']} × {env['device']}",
          "",
          f"{env['date_utc']}; torch {env['torch']} (CUDA {env['cuda']}, NCCL "
          f"{env.get('nccl')}), triton {env['triton']}, Python {env['python']}; "
          f"git {env['git']}, fa3_inductor sources sha1 {env['sources_sha1']}.",
          "",
          f"Command: `{env['command']}`",
          "",
          f"Settings: {json.dumps({k: env['args'][k] for k in SETTINGS})}; "
          f"environment: {json.dumps(env['env'])}.",
          "",
          "TFLOP/s per GPU: FLOPs of the whole attention (causal: 4·B·H·D·T²/2; fwd+bwd 3.5×) ÷ "
          "GPUs ÷ the slowest rank's median time. \"single\": our kernel on one GPU at the "
          "per-GPU length (its own FLOPs); FP8 rows (inference, forward only) ÷ \"single_fp8\". "
          "Peak: max_memory_allocated during fwd+bwd (FP8 rows: forward), inputs "
          "included. " + ("" if finished else "**Run not finished (written after each size).**"),
          "",
          table(rows), ""]
    for c in checks:
        errs = ", ".join(f"{k[:-8]} {v:.1e}" for k, v in c.items() if k.endswith("_rel_err")
                         and not k.startswith("worst_"))
        md.append(f"Check ({c['total']} tokens, against our kernel on the whole sequence): "
                  f"{c['status']}; relative errors: {errs or '-'}")
    if errors:   # each distinct error once, with the sizes it happened at
        md += ["", "## Errors", ""]
        seen: dict[tuple, list] = {}
        for r in errors:
            seen.setdefault((r["impl"], r["error"]), []).append(str(r["per_gpu"]))
        for (impl, error), sizes in seen.items():
            md += [f"- {impl} at {', '.join(sizes)} per GPU:", "", "```", error, "```"]
    with open(path_stem.with_suffix(".md"), "w") as f:
        f.write("\n".join(md) + "\n")


# ---------------------------------------------------------------- dist mode

def init_distributed(args):
    """Start the process group (NCCL with --device cuda, gloo with cpu) for torchrun's env.

    Example::

        >>> comm = init_distributed(args)          # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("ring_attention.py dist: launch with torchrun (or python -m "
                         "torch.distributed.run) --nproc-per-node N")
    timeout = datetime.timedelta(seconds=args.collective_timeout_s)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("ring_attention.py dist: no CUDA device; use --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        try:
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        except TypeError:   # a torch without device_id
            dist.init_process_group("nccl", timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return Comm(device)


def run_dist(args, comm: Optional[Comm] = None, out_stem: Optional[Path] = None) -> list[dict]:
    """The dist mode (module docstring): every rank runs it; rank 0 prints and writes results.
    ``comm``: an already started process group (tests); otherwise torchrun's environment.

    Example::

        >>> rows = run_dist(parse_args(["dist", "--device", "cpu"]))   # doctest: +SKIP
    """
    env_before = set_no_multicast_env()
    os.environ.setdefault("FA3_INDUCTOR_VARIANTS", "off")   # no sibling compiles during timings
    import torch

    started = time.monotonic()
    own_group = comm is None
    comm = comm or init_distributed(args)
    if args.kernel == "auto":
        from fa3_inductor.api import _runs_our_kernels

        probe = torch.empty(1, device=comm.device)
        args.kernel = "fa3" if _runs_our_kernels(probe) else "dense"
    env = environment(args, comm, env_before)
    if out_stem is None and args.out:
        device_slug = _slug(env["device"].split(" (")[0])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
        stem = comm.gather(f"ring-{device_slug}-x{comm.world}-{stamp}")[0]   # rank 0's name
        out_stem = Path(args.out) / stem
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"ring_attention dist: {comm.world} × {env['device']}, torch {env['torch']}, "
        f"kernel {args.kernel}, budget {args.budget_s:.0f} s", flush=True)
    rows: list[dict] = []

    def save(finished: bool = False) -> None:
        if comm.rank == 0 and out_stem is not None:
            write_results(out_stem, env, rows, finished)

    try:
        if args.check_per_gpu:
            check_start = time.monotonic()
            rows.append(check(args, comm))
            rows[-1]["seconds"] = round(time.monotonic() - check_start, 1)
            say(json.dumps(rows[-1]), flush=True)
            save()
        last: Optional[tuple[int, list]] = None     # (total, rows) of the last size run
        for per_gpu in args.per_gpu:
            total = per_gpu * comm.world
            elapsed = time.monotonic() - started
            predicted = estimate_s(comm.world, per_gpu, args) if last is None else \
                predict_s(last[1], (total / last[0]) ** 2)
            if comm.any(elapsed + predicted > args.budget_s):
                for impl in args.impls:
                    rows.append({"world": comm.world, "per_gpu": per_gpu, "total": total,
                                 "impl": impl, "status": f"skipped: budget ({elapsed:.0f} s "
                                 f"spent, ~{predicted:.0f} s predicted, {args.budget_s:.0f} s)"})
                say(f"per-GPU {per_gpu}: skipped, ~{predicted:.0f} s predicted, "
                    f"{elapsed:.0f} s of {args.budget_s:.0f} s spent", flush=True)
                save()
                continue
            size_start = time.monotonic()
            case, error = None, None
            try:
                case = Case(args, comm, per_gpu)
            except Exception as exc:   # e.g. out of memory: recorded, next size
                error = f"{type(exc).__name__}: {exc}"
            errors = comm.gather(error)
            if any(e is not None for e in errors):
                first = next(e for e in errors if e is not None)
                rows += [{"world": comm.world, "per_gpu": per_gpu, "total": total, "impl": impl,
                          "status": f"error making inputs: {first.splitlines()[0]}",
                          "error": first} for impl in args.impls]
                say(rows[-1]["status"], flush=True)
                save()
                case = None
                _free(comm.device, collect=True)
                continue
            for impl in args.impls:
                spent = time.monotonic() - started
                if comm.any(spent > args.budget_s):
                    rows.append({**case.row(impl), "status": f"skipped: budget ({spent:.0f} s "
                                 f"spent of {args.budget_s:.0f} s)"})
                else:
                    rows.append(measure(case, impl, max_s=args.max_impl_s))
                say(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
                save()
            del case
            _free(comm.device, collect=True)
            last = (total, rows[-len(args.impls):])
            say(f"per-GPU {per_gpu}: {time.monotonic() - size_start:.0f} s", flush=True)
    finally:
        save(finished=True)
        if own_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                comm.barrier()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    if comm.rank == 0:
        if out_stem is not None:
            print(f"results: {out_stem}.json, {out_stem}.md")
        print(table(rows), flush=True)
    return rows if comm.rank == 0 else []


# ---------------------------------------------------------------- emulate, balance

def run_emulate(args) -> list[dict]:
    """All ranks of an n-rank ring in one process on one device: per (rank, step) shard time,
    alone and with a concurrent K/V-shard copy on a side stream (CUDA), the merge's time, and each
    step's backward as the ring runs it (the shard's gradients from the merged output and LSE,
    no forward). The slowest rank's sums give the ring's kernel-bound TFLOP/s per GPU, forward and
    forward + backward (3.5x the forward's FLOPs, as dist counts them)."""
    import torch

    import fa3_inductor
    from fa3_inductor.distributed import SeqLayout
    from fa3_inductor.distributed.merge import Merger
    from fa3_inductor.distributed.ring import _RingCall
    from fa3_inductor.distributed.shard_attention import (shard_attention,
                                                          shard_attention_backward)

    dev = torch.device(args.device)
    comm = Comm(dev)
    kernel = "fa3" if args.kernel == "auto" else args.kernel
    dtype = _dtype(args.dtype)
    rows = []
    for world in args.world:
        layout = SeqLayout(world)
        for per_gpu in args.per_gpu:
            total = per_gpu * world
            full = [torch.randn(args.batch, h, total, args.head_dim, device=dev, dtype=dtype)
                    for h in (args.heads, args.kv_heads, args.kv_heads)]
            shards = [[layout.shard(t, 2, r) for t in full] for r in range(world)]
            mask = make_mask(args.mask, total, dev)
            side = torch.cuda.Stream() if dev.type == "cuda" else None
            per_rank, per_rank_overlap, per_rank_bwd, merge_ms = [], [], [], 0.0
            for r in range(world):
                call = _RingCall(None, r, world, layout, total, total, None, mask,
                                 args.head_dim ** -0.5, args.kv_heads != args.heads, kernel)
                q = shards[r][0]
                alone = overlap = 0.0
                parts, steps = [], []
                for s in range(world):
                    src = (r - s) % world
                    k, v = shards[src][1], shards[src][2]
                    m = call.mods(src, dev)

                    def run(q=q, k=k, v=v, m=m):
                        return shard_attention(q, k, v, m, call.scale, call.enable_gqa, kernel)
                    if run() is None:
                        continue          # hidden shard: the ring skips it as well
                    alone += time_call(comm, run, args.reps, 60.0)["ms"]
                    if side is not None:
                        dst_k, dst_v = torch.empty_like(k), torch.empty_like(v)

                        def with_copy(k=k, v=v, dst_k=dst_k, dst_v=dst_v, run=run):
                            side.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(side):
                                dst_k.copy_(k)
                                dst_v.copy_(v)
                            out = run()
                            torch.cuda.current_stream().wait_stream(side)
                            return out
                        overlap += time_call(comm, with_copy, args.reps, 60.0)["ms"]
                    parts.append(run())
                    steps.append((k, v, m))
                merger = Merger()
                merge_ms += time_call(comm, lambda: [merger.add(*p) for p in parts], args.reps,
                                      60.0)["ms"] / max(len(parts), 1)
                merged = Merger()
                for p in parts:
                    merged.add(*p)
                out, lse = merged.result(dtype, torch.empty_like(q), q.shape[:3])
                dout = torch.randn_like(out)
                backward = 0.0
                for k, v, m in steps:
                    backward += time_call(comm, lambda k=k, v=v, m=m: shard_attention_backward(
                        q, k, v, out, lse, dout, None, m, call.scale, kernel), args.reps,
                        60.0)["ms"]
                per_rank.append(alone)
                per_rank_overlap.append(overlap if side is not None else None)
                per_rank_bwd.append(backward)
            flops = attention_flops(args.batch, args.heads, args.head_dim, args.mask, total) / world
            single = time_call(comm, lambda: single_attention(
                shards[0][0], shards[0][1], shards[0][2], make_mask(args.mask, per_gpu, dev),
                args.kv_heads != args.heads, kernel), args.reps, 60.0)["ms"]
            both = [f + b for f, b in zip(per_rank, per_rank_bwd)]
            row = {"world": world, "per_gpu": per_gpu, "mask": args.mask, "rank_ms": per_rank,
                   "rank_ms_with_copy": per_rank_overlap, "rank_bwd_ms": per_rank_bwd,
                   "slowest_rank_tflops": flops / max(per_rank) / 1e9,
                   "slowest_rank_fwdbwd_tflops": 3.5 * flops / max(both) / 1e9,
                   "single_tflops": attention_flops(args.batch, args.heads, args.head_dim,
                                                    args.mask, per_gpu) / single / 1e9,
                   "merge_ms_per_step": merge_ms / world,
                   "template": fa3_inductor.last_template() if kernel == "fa3" else "dense"}
            if side is not None:
                row["slowest_rank_with_copy_tflops"] = flops / max(per_rank_overlap) / 1e9
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run_balance(args) -> list[dict]:
    """Visited 128 x 128 tiles per rank for contiguous and head-tail layouts (CPU)."""
    import torch

    from fa3_inductor.distributed import SeqLayout

    total, block = args.total, 128
    rows = []
    for world in args.world:
        for mask_name in ("causal", "window", "document"):
            mask = make_mask(mask_name, total, "cpu")
            for head_tail in (False, True):
                layout = SeqLayout(world, head_tail=head_tail)
                # a tile is visited when any (q, kv) pair in it survives (tiles never straddle
                # pieces)
                starts = torch.arange(0, total, block)
                qb, kb = starts.view(-1, 1), starts.view(1, -1)
                corners = [mask(0, 0, qb + dq, kb + dk) for dq in (0, block - 1)
                           for dk in (0, block - 1)]
                visited = corners[0] | corners[1] | corners[2] | corners[3]
                if mask_name == "document":   # a document boundary inside a tile: corners miss it
                    visited = visited | _document_tiles(total, block)
                blocks = [layout.positions(r, total)[::block] // block for r in range(world)]
                tiles = [int(visited[blocks[r]].sum()) for r in range(world)]
                # the ring's steps are lock-step: step s lasts as long as its busiest rank
                critical = sum(max(int(visited[blocks[r]][:, blocks[(r - s) % world]].sum())
                                   for r in range(world)) for s in range(world))
                rows.append({"world": world, "mask": mask_name,
                             "layout": "head_tail" if head_tail else "contiguous",
                             "tiles_per_rank": tiles,
                             "imbalance": max(tiles) / (sum(tiles) / len(tiles)),
                             "ring_efficiency": sum(tiles) / (world * critical)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _document_tiles(total: int, block: int):
    import torch

    doc = torch.arange(total) // max(total // DOCUMENTS, 1)
    first, last = doc[::block], doc[block - 1::block]
    n = total // block
    return (first.view(n, 1) <= last.view(1, n)) & (last.view(n, 1) >= first.view(1, n)) & \
        (torch.arange(n).view(n, 1) >= torch.arange(n).view(1, n))


# ---------------------------------------------------------------- command line

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (module docstring).

    Example::

        >>> parse_args(["dist", "--device", "cpu"]).device
        'cpu'
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("dist", "plan", "emulate", "balance"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="dist: cuda (NCCL) or cpu (gloo); emulate: where to run")
    parser.add_argument("--per-gpu", type=int, nargs="+", default=[65536, 131072],
                        help="tokens per GPU (T = GPUs x this), run in this order (put the "
                             "size that matters most first: the budget skips the last ones)")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4],
                        help="plan / emulate / balance: ranks")
    parser.add_argument("--total", type=int, default=131072, help="balance: global length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--mask", choices=("causal", "window", "document"), default="causal")
    parser.add_argument("--kernel", choices=("auto", "fa3", "dense"), default="auto",
                        help="per-shard kernel: auto = fa3 on CUDA or under TRITON_INTERPRET=1, "
                             "else dense")
    parser.add_argument("--impls", nargs="+",
                        choices=IMPLS + FP8_IMPLS + ("torch_cp_efficient", "torch_cp_math"),
                        default=None, help=f"default: {' '.join(IMPLS)}; FP8 (inference, forward "
                                           f"only): {' '.join(FP8_IMPLS)}")
    parser.add_argument("--reps", type=int, default=3, help="timed calls after the first")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="dist: skip sizes / implementations that would end past this")
    parser.add_argument("--max-impl-s", type=float, default=40.0,
                        help="dist: stop timing one implementation's calls after this")
    parser.add_argument("--check-per-gpu", type=int, default=-1,
                        help="dist: tokens per GPU of the correctness check (default: the first "
                             "--per-gpu, whose ring kernels it compiles; 0: no check)")
    parser.add_argument("--collective-timeout-s", type=int, default=300,
                        help="dist: a collective waiting longer aborts the run")
    parser.add_argument("--assume-tflops", type=float, default=450.0,
                        help="plan / budget: per-GPU TFLOP/s the time model assumes")
    parser.add_argument("--out", help="dist: results folder (ring-<device>-x<N>-<date>.json/.md); "
                                      "emulate / balance: <out>.json")
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.impls is None:
        args.impls = list(IMPLS)
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.mode == "dist":
        run_dist(args)
        return
    rows = {"plan": run_plan, "emulate": run_emulate, "balance": run_balance}[args.mode](args)
    if args.out and rows:
        with open(args.out + ".json", "w") as f:
            json.dump({"mode": args.mode, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
