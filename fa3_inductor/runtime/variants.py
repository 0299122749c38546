"""One compile per kind of attention site, not per sequence length.

Triton compiles a kernel once per *specialization key*: the constexprs, the types of the other
arguments, and hints on them (an integer divisible by 16, an integer equal to 1, a 16-byte aligned
pointer). Our kernels read sequence lengths at run time and mark the integers that follow the
lengths ``do_not_specialize``, so a new length gives the same key, except where a length picks a
variant that is worth its own code: a KV length that is a multiple of the tile (EVEN_N: no bound
mask), the Hopper kernel's persistent schedule (short KV tiles), the generic kernel's tiles for long
plain sites. A family's ``prepare`` returns a launch together with its *siblings* (the same site under the
other choices); :func:`start_variants` compiles the launch and then the siblings in a background
thread, so that later lengths find their kernel compiled.

Why in the background: a Hopper compile takes 2.5-4 s; compiling the three siblings first would
quadruple the first call. The compiles mostly run outside the GIL (measured on the CPU machine: the
main thread ran through a 3.5 s compile with 0.5 s of stalls, the longest 0.24 s) and fill Triton's
on-disk cache as well, so a second process finds all four. ``FA3_INDUCTOR_VARIANTS=sync`` compiles
them before the first call returns, ``off`` not at all.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import inspect
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch

Launch = tuple  # (kernel, args, kwargs, grid)

# One thread: Triton's compile is partly Python, so more threads slow the caller's own work (GIL).
_WORKERS = 1
_lock = threading.Lock()
_inflight: dict[tuple, Future] = {}
_jobs: "queue.Queue[tuple]" = queue.Queue()
_threads: list[threading.Thread] = []


def specialization_key(kernel: Any, args: Sequence, kwargs: dict, target: Any = None) -> str:
    """The key under which Triton's JIT caches the kernel a launch needs (``JITFunction.run``'s
    ``compute_cache_key`` of its binder's specialization), computed without a GPU.

    ``kernel`` is a ``@triton.jit`` / ``@gluon.jit`` kernel (an interpreted one is keyed as the JIT
    would key it); ``target`` a ``GPUTarget`` (default sm90). Constexpr jit functions (mods) enter
    by their source hash, as in the JIT, so keys compare across processes.

    Example::

        >>> kernel, args, kwargs, grid = prepare_generic(q, k, v, out, lse, mx, sm_scale=0.1)  # doctest: +SKIP
        >>> specialization_key(kernel, args, kwargs).startswith("[('tensordesc")               # doctest: +SKIP
        True
    """
    from triton.runtime.jit import compute_cache_key

    jit = _as_jit(kernel)
    binder = _binder(jit, _target_key(target))
    kwargs = {k: _constexpr_key(v) for k, v in kwargs.items()}
    _, specialization, options = binder(*args, **_run_kwargs(jit, kwargs))
    return compute_cache_key({}, specialization, options)


def disk_cache_key(kernel: Any, args: Sequence, kwargs: dict, target: Any = None) -> str:
    """The key of Triton's on-disk cache for the same launch (``triton.compile``'s): what a second
    process must reproduce to load the kernel instead of compiling it.

    Example::

        >>> len(disk_cache_key(kernel, args, kwargs))   # doctest: +SKIP
        64
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.cache import get_cache_key
    from triton.runtime.jit import create_function_from_signature
    from triton._C.libtriton import get_cache_invalidating_env_vars

    jit = _as_jit(kernel)
    target = target or GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = _run_kwargs(jit, {k: _constexpr_key(v) for k, v in kwargs.items()})
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    source_cls = ASTSource
    if jit.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    src = source_cls(jit, signature, constexprs, attrs)
    return get_cache_key(src, backend, options, get_cache_invalidating_env_vars())


def start_variants(variants: tuple, device: torch.device) -> Launch:
    """Of a family's ``(launch, siblings)`` (``KernelFamily.prepare``): compile ``launch`` now and its
    siblings in the background (see the module docstring); returns ``launch`` as
    ``(kernel, args, kwargs, grid)``. Where a background compile of this very launch is under way,
    waits for it instead of compiling again.

    Example::

        >>> kernel, args, kwargs, grid = start_variants(family.prepare(call), q.device)  # doctest: +SKIP
        >>> kernel[grid](*args, **kwargs)                                                # doctest: +SKIP
    """
    launch, siblings = variants
    mode = os.environ.get("FA3_INDUCTOR_VARIANTS", "background")
    if device.type != "cuda" or mode == "off":
        return launch
    own = _inflight_future(launch, device)
    if own is not None:
        own.result()
    else:   # compile this launch before its siblings start competing with it for the GIL
        kernel, args, kwargs, grid = launch
        with torch.cuda.device(device):
            kernel.run(*args, grid=grid, warmup=True, **kwargs)
    futures = [compile_ahead(s, device) for s in siblings]
    if mode == "sync":
        for f in futures:
            f.result()
    return launch


def compile_ahead(launch: Launch, device: torch.device) -> Future:
    """Compile ``launch`` on a background thread unless it is compiled or under way; returns a future
    that is done when it is (its result: the compiled kernel, or None when nothing was compiled).

    Example::

        >>> compile_ahead((kernel, args, kwargs, grid), q.device).result()   # doctest: +SKIP
    """
    ident = _launch_ident(launch, device)
    with _lock:
        running = _inflight.get(ident)
        if running is not None:
            return running
        done: Future = Future()
        if _is_compiled(launch, device):
            done.set_result(None)
            return done
        _inflight[ident] = done
        _start_workers()
    _jobs.put((ident, stand_in(launch), device, done))
    return done


def stand_in(launch: Launch) -> Launch:
    """``launch`` with every tensor (and every TMA descriptor's base) replaced by a meta tensor of the same
    shape, strides and dtype: what Triton specializes a compile on, without keeping the caller's memory.

    A queued sibling must not hold the call's tensors: under CUDA graph trees (``mode="reduce-overhead"``,
    ``"max-autotune"``) they come from the graph's private pool, whose check at the end of a warm-up or a
    recording fails on any allocation still alive that is not an output ("Detected 4 tensor(s) in the
    cudagraph pool not tracked as outputs", seen on an H100 with the four block-mask tables). A meta tensor's
    address is 0, which Triton specializes as 16-byte aligned, as it does the addresses a launch has
    (fast_launch keys launches by alignment too).

    Example::

        >>> stand_in((kernel, (q, 0.5), {}, (1,)))[1][0].device   # doctest: +SKIP
        device(type='meta')
    """
    kernel, args, kwargs, grid = launch
    return kernel, tuple(_meta(a) for a in args), {k: _meta(v) for k, v in kwargs.items()}, grid


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and dataclasses.is_dataclass(value):
        return dataclasses.replace(value, base=_meta(base))
    return value


def wait_for_variants(timeout: Optional[float] = None) -> int:
    """Wait until every background compile started so far has finished; returns how many were waited
    for. Errors of those compiles are raised here.

    Example::

        >>> fa3_inductor.flex(q, k, v); wait_for_variants()   # doctest: +SKIP
        3
    """
    with _lock:
        pending = list(_inflight.values())
    for f in pending:
        f.result(timeout)
    return len(pending)


def pending_variants() -> int:
    """How many background compiles are queued or running.

    Example::

        >>> pending_variants()
        0
    """
    with _lock:
        return len(_inflight)


def _target_key(target: Any) -> tuple:
    return (target.backend, target.arch, target.warp_size) if target is not None else ("cuda", 90, 32)


_BINDERS: dict[tuple, tuple] = {}


def _binder(jit: Any, target: tuple) -> Any:
    """JITFunction.create_binder's binder for ``target``, without a device (kept by the kernel's id:
    hashing a JITFunction hashes its source tree)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    hit = _BINDERS.get((id(jit), target))
    if hit is None or hit[0] is not jit:
        backend = make_backend(GPUTarget(*target))
        hit = _BINDERS[(id(jit), target)] = (jit, create_function_from_signature(jit.signature, jit.params,
                                                                                 backend))
    return hit[1]


def _constexpr_key(value: Any) -> Any:
    """An interpreted jit function (a mod under TRITON_INTERPRET=1) by its source hash, as the JIT keys
    a jit function by its cache_key (its source and its callees'; the callees are package code)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(value, InterpretedFunction):
        return value
    return "jit:" + hashlib.sha256(inspect.getsource(value.fn).encode()).hexdigest()


def _as_jit(fn: Any) -> Any:
    """A JITFunction for ``fn`` where it is an interpreted kernel (TRITON_INTERPRET=1), else ``fn``."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(fn, InterpretedFunction):
        return fn
    cached = getattr(fn, "_fa3_as_jit", None)
    if cached is None:
        from triton.runtime.jit import JITFunction

        cached = JITFunction(fn.fn, **fn.kwargs)   # gluon.jit never interprets: plain Triton here
        fn._fa3_as_jit = cached
    return cached


def _run_kwargs(jit: Any, kwargs: dict) -> dict:
    """The keywords JITFunction.run hands its binder (it adds these two)."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kwargs


def _device_key(launch: Launch, device: torch.device) -> tuple[dict, str]:
    """(the kernel's compiled-kernel cache on ``device``, the launch's key in it), as JITFunction.run
    computes them."""
    from triton.runtime.jit import compute_cache_key

    kernel, args, kwargs, _ = launch
    with torch.cuda.device(device):
        from triton.runtime.driver import driver
        kernel_cache, key_cache, _, _, binder = kernel.device_caches[driver.active.get_current_device()]
    _, specialization, options = binder(*args, **_run_kwargs(kernel, kwargs))
    return kernel_cache, compute_cache_key(key_cache, specialization, options)


def _launch_ident(launch: Launch, device: torch.device) -> tuple:
    return (id(launch[0]), device.index, _device_key(launch, device)[1])


def _is_compiled(launch: Launch, device: torch.device) -> bool:
    cache, key = _device_key(launch, device)
    return key in cache


def _inflight_future(launch: Launch, device: torch.device) -> Optional[Future]:
    with _lock:
        return _inflight.get(_launch_ident(launch, device))


def _drain_at_exit() -> None:
    """At interpreter exit, drop the compiles still queued and let the running one finish: a daemon
    thread stopped inside Triton's C++ compiler aborts the process ("FATAL: exception not
    rethrown", exit code 134), seen on an H100 when pytest ended with variants compiling."""
    while True:
        try:
            ident, _, _, done = _jobs.get_nowait()
        except queue.Empty:
            break
        with _lock:
            _inflight.pop(ident, None)
        done.set_result(None)
    with _lock:
        running = list(_inflight.values())
    for f in running:
        try:
            f.result(timeout=120)
        except BaseException:   # its error no longer matters: nothing will launch it
            pass


def _start_workers() -> None:
    # Daemon threads: a process may exit with compiles queued (Triton writes its cache atomically);
    # _drain_at_exit lets a running compile finish first.
    if not _threads:
        atexit.register(_drain_at_exit)
    while len(_threads) < _WORKERS:
        t = threading.Thread(target=_worker, name=f"fa3-variants-{len(_threads)}", daemon=True)
        _threads.append(t)
        t.start()


def _worker() -> None:
    while True:
        ident, launch, device, done = _jobs.get()
        kernel, args, kwargs, grid = launch
        try:
            with torch.cuda.device(device):   # the JIT caches per current device
                compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
            done.set_result(compiled)
        except BaseException as exc:   # reported by wait_for_variants / the waiting launch
            done.set_exception(exc)
        finally:
            with _lock:
                _inflight.pop(ident, None)
