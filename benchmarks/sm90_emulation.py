"""Our ops' CUDA host path on the CPU, launches stubbed: the H200's planning and launch-cache hits
emulated on CPU tensors, so that the host cost of a cached call (and the code that builds it) can be
timed and smoke-tested without a GPU.

Under :func:`emulated_sm90`:

* the planner sees compute capability (9, 0) (``SiteFacts`` / ``BackwardSiteFacts.capability``), so a
  bf16 D64 site lists the families the H200 lists (hopper, generic, torch; hopper_bwd, generic_bwd);
* every tensor says ``is_cuda`` (a shadowing property on ``torch.Tensor``), so runtime/ops.py and
  runtime/ops_bwd.py take their CUDA branch: launch key, ``fast_launch.recorded``, ``relaunch``;
* ``fast_launch.launch_cached`` as the ops imported it records the family's launch as on a GPU: the
  family's own ``prepare`` / ``prepare_backward`` builds the arguments (the Hopper kernels' TMA
  descriptors included), ``fast_launch._record`` makes the recipe, and the entry gets a stand-in of
  triton's C launcher (``_compat.CLauncher``) whose ``launch`` does nothing and whose ``expand`` gives
  a descriptor's C arguments of the right width (1 + 2 x rank) without encoding a CUtensorMap. Nothing
  is compiled or run;
* the current stream is 0, and torch.cuda's device queries answer for an H200 as device 0 (132 SMs,
  no graph capture).

So a second call of a key runs exactly the GPU's hit path (the op's dispatch, allocations, key,
lookup, ``_launch_direct`` with its per-address argument tuple) up to the C launch itself.

Example::

    >>> with emulated_sm90():                               # doctest: +SKIP
    ...     torch.ops.fa3_inductor.flex_fwd.default(q, k, v, *tables, [], [], 0.125, 128, 128, spec)
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


class _Kernel:
    """What a recorded entry reads of triton's CompiledKernel on the direct path."""

    function = 0
    packed_metadata = None

    def run(self, *args) -> None:   # the launch-hook path (a profiler's hooks active): no launch either
        pass

    def launch_metadata(self, *args) -> None:
        return None


def _no_launch(*args) -> None:
    pass


class _Param:
    def __init__(self, p):
        self.name, self.has_default, self.default = p.name, p.default is not p.empty, p.default


class _Params:
    """A Triton kernel's parameters as fast_launch._record reads them (``.params``), also for an
    interpreted one (TRITON_INTERPRET=1 makes every ``@triton.jit`` function an InterpretedFunction)."""

    def __init__(self, jit_fn):
        import inspect

        self.params = [_Param(p) for p in inspect.signature(jit_fn.fn).parameters.values()]


def _with_params(jit_fn):
    return jit_fn if hasattr(jit_fn, "params") else _Params(jit_fn)


def _emulated_launch_cached(key, inputs, prepare):
    """fast_launch.launch_cached, recording as on a GPU, launching nothing."""
    from fa3_inductor._compat import CLauncher
    from fa3_inductor.runtime import fast_launch as fl

    entry = fl._CACHE.get(key)
    if entry is not None and entry.kernel is not None:
        fl._relaunch(entry, inputs)
        return entry.tag
    jit_fn, args, kwargs, grid, tag = prepare()
    if entry is not None:
        return tag
    try:
        recipe = fl._record(_with_params(jit_fn), args, kwargs, inputs)
    except fl._Uncacheable:
        fl._CACHE[key] = fl._Launch(None, (1, 1, 1), (), (), tag)
        return tag
    grid = tuple(grid) + (1,) * (3 - len(grid))
    constants = tuple(step[1] if step[0] == "const" else None for step in recipe)
    slots = tuple((pos, step) for pos, step in enumerate(recipe) if step[0] != "const")
    metas = {pos: len(step[3].get("block_shape", ())) for pos, step in enumerate(recipe)
             if step[0] == "descriptor"}
    direct = CLauncher(_no_launch, False, False, metas,
                       lambda desc, rank: (0,) * (1 + 2 * len(desc.shape)))
    kernel, encoded = _Kernel(), {}
    direct_args = fl._DirectArgs.of(kernel, grid, recipe, direct, inputs, encoded)
    fl._CACHE[key] = fl._Launch(kernel, grid, constants, slots, tag, direct, encoded, direct_args,
                                inputs[0].device.index)
    return tag


_ABSENT = object()


class _H200Properties:
    multi_processor_count = 132
    major, minor = 9, 0
    name = "NVIDIA H200 (emulated)"


# what the planning and the families ask torch.cuda (an H200 as device 0, no graph capture)
_CUDA_QUERIES = {
    "current_device": lambda: 0,
    "get_device_capability": lambda device=None: (9, 0),
    "get_device_properties": lambda device=None: _H200Properties(),
    "is_current_stream_capturing": lambda: False,
    "synchronize": lambda device=None: None,
}


@contextlib.contextmanager
def emulated_sm90() -> Iterator[None]:
    """The module docstring's emulation, undone on exit (fast_launch's cache cleared both ways: its
    entries are stand-ins)."""
    from fa3_inductor.runtime import fast_launch, kernel_failures, ops, ops_bwd
    from fa3_inductor.templates import family

    saved = [(family.SiteFacts, "capability", family.SiteFacts.__dict__["capability"]),
             (family.BackwardSiteFacts, "capability", family.BackwardSiteFacts.__dict__.get("capability", _ABSENT)),
             (torch.Tensor, "is_cuda", torch.Tensor.__dict__.get("is_cuda", _ABSENT)),
             (fast_launch, "_get_stream", fast_launch._get_stream),
             (ops, "launch_cached", ops.launch_cached),
             (ops_bwd, "launch_cached", ops_bwd.launch_cached)]
    saved += [(torch.cuda, name, getattr(torch.cuda, name)) for name in _CUDA_QUERIES]
    sm90 = property(lambda self: (9, 0))
    family.SiteFacts.capability = sm90
    family.BackwardSiteFacts.capability = sm90
    torch.Tensor.is_cuda = property(lambda self: True)
    fast_launch._get_stream = lambda device: 0
    ops.launch_cached = ops_bwd.launch_cached = _emulated_launch_cached
    for name, value in _CUDA_QUERIES.items():
        setattr(torch.cuda, name, value)
    fast_launch.clear()
    kernel_failures.clear()   # a failure recorded off the emulation would pass a family over
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is _ABSENT:   # a class attribute set here shadowed a base class's
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        fast_launch.clear()
        kernel_failures.clear()


def train_small_layouts(B: int = 8, H: int = 8, S: int = 2048, D: int = 64,
                        dtype: torch.dtype = torch.bfloat16) -> dict:
    """One attention layer's tensors as benchmarks/train_small.py's compiled step hands them to our ops
    (captured from its compiled graph on the CPU): q, k contiguous (B, H, S, D) (RoPE's outputs), v a
    view of the fused QKV projection's output (B, S, 3·H·D) permuted to (B, H, S, D), dO (B, S, H, D)
    storage seen as (B, H, S, D) (the output projection's gradient), out and lse contiguous.

    Example::

        >>> sorted(train_small_layouts(1, 2, 128, 64))
        ['dout', 'k', 'lse', 'out', 'q', 'v']
    """
    q, k = (torch.randn(B, H, S, D, dtype=dtype) for _ in range(2))
    qkv = torch.randn(B, S, 3, H, D, dtype=dtype)
    v = qkv.permute(2, 0, 3, 1, 4)[2]
    dout = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)
    out = torch.randn(B, H, S, D, dtype=dtype)
    lse = torch.randn(B, H, S, dtype=torch.float32)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}


def train_small_specs(q: torch.Tensor) -> tuple[str, str]:
    """(forward spec, backward spec) of train_small's causal site for ``q``'s shape and dtype, planned as
    on the H200 (call under :func:`emulated_sm90`): flex()'s direct planning, which plans as the lowering.

    Example::

        >>> with emulated_sm90(): fwd, bwd = train_small_specs(q)   # doctest: +SKIP
    """
    from torch.nn.attention.flex_attention import create_block_mask

    from fa3_inductor import direct, direct_bwd, mods

    S = q.shape[2]
    bm = create_block_mask(mods.causal, None, None, S, S, device="cpu")
    fwd = direct.cached_plan(q, q, q, None, mods.causal, bm, "auto").spec
    bwd = direct_bwd.plan_backward(q, q, q, None, mods.causal, bm).spec
    return fwd, bwd
