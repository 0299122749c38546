"""Compile a kernel launch for a GPU target without a GPU, and read what the compiler made.

How CI checks the Hopper code paths on a CPU machine (docs/facts.md): the arguments are specialized
exactly as the JIT would specialize them at launch, handed to ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, and the cubin is read with the ``cuobjdump`` shipped in the
triton wheel (registers, stack, spills, HGMMA / setmaxnreg instructions).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any, Optional

import triton


def compile_launch(kernel: Any, args: tuple, kwargs: dict, target: Optional[Any] = None) -> Any:
    """Compile what ``kernel[grid](*args, **kwargs)`` would launch, for ``target`` (sm90 default).

    Works for ``@triton.jit`` and ``@gluon.jit`` kernels (not under TRITON_INTERPRET=1, where
    ``@triton.jit`` kernels are interpreted functions). Tensors may live on the CPU.

    Example::

        >>> ck = compile_launch(kernel, args, kwargs)        # doctest: +SKIP
        >>> sass_report(ck).hgmma > 0                        # doctest: +SKIP
        True
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if not hasattr(kernel, "_pack_args"):
        raise TypeError(f"compile_launch needs a JIT kernel, got {type(kernel).__name__} "
                        "(is TRITON_INTERPRET=1 set? compile in a process without it)")
    target = target or GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    source_cls = ASTSource
    if type(kernel).__module__.startswith("triton.experimental.gluon"):
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    src = source_cls(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


@dataclasses.dataclass
class SassReport:
    """Resource usage and instruction counts of one compiled kernel."""

    registers: int
    stack: int
    local: int
    shared: int
    sass: str
    ptx: str

    @property
    def hgmma(self) -> int:
        return self.sass.count("HGMMA")

    @property
    def spill_instructions(self) -> int:
        return len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\b", self.sass))

    def _instructions_and_loops(self) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
        """(address, instruction) of the SASS, and the (first, last) address of every loop (a backward branch)."""
        ins = [(int(a, 16), text.strip()) for a, text in
               re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", self.sass)]
        loops = []
        for addr, text in ins:
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
        return ins, loops

    @staticmethod
    def _innermost(ins: list[tuple[int, str]], loops: list[tuple[int, int]]) -> list[list[str]]:
        inner = [(lo, hi) for lo, hi in loops
                 if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
        return [[t for a, t in ins if lo <= a <= hi] for lo, hi in inner]

    def inner_loops(self) -> list[list[str]]:
        """Instruction lists of the innermost loops (a backward branch whose body holds no other
        backward branch), in address order: the KV loops of an attention kernel are among them.

        Example::

            >>> [len(body) for body in r.inner_loops() if "MUFU.EX2" in " ".join(body)]  # doctest: +SKIP
            [459, 459]
        """
        return self._innermost(*self._instructions_and_loops())

    def loops_with(self, token: str) -> list[list[str]]:
        """Instruction lists of the innermost loops that hold ``token``: loops whose body holds it and holds no
        other loop that does (a step loop with a spin-wait loop inside it is still the step loop).

        Example::

            >>> [len(body) for body in r.loops_with("HGMMA")]  # doctest: +SKIP
            [474, 456]
        """
        ins, loops = self._instructions_and_loops()
        return self._innermost(ins, [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and token in t for a, t in ins)])

    @property
    def setmaxnreg(self) -> set[int]:
        return {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", self.ptx)}


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_report(compiled: Any) -> SassReport:
    """Read registers, stack, spills and SASS of a compiled kernel with the wheel's cuobjdump.

    Example::

        >>> r = sass_report(compile_launch(kernel, args, kwargs))   # doctest: +SKIP
        >>> (r.stack, r.spill_instructions)                         # doctest: +SKIP
        (0, 0)
    """
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {res!r}")
    return SassReport(int(m.group(1)), int(m.group(2)), int(m.group(4)),
                      int(compiled.metadata.shared), sass, compiled.asm["ptx"])
