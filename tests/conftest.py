"""Shared pytest configuration.

Markers (declared in pyproject.toml):
  gpu           needs a CUDA device (an H100/H200 for the Hopper template); skipped without one.
  sm90_compile  compiles kernels for sm90 on the CPU. Triton's interpreter (TRITON_INTERPRET=1)
                turns every ``@triton.jit`` function into an interpreted one, which cannot be
                compiled, so these run in their own session: ``pytest -m sm90_compile``
                (``make test`` runs both sessions).

Without a GPU, every other session runs our Triton kernels on CPU tensors under the
interpreter: TRITON_INTERPRET=1 is set here, before anything imports triton.
"""

import os

import pytest
import torch

# Files whose module-scoped fixtures are expensive (forked gloo ranks, compiled kernels, built
# models): under pytest-xdist (make test runs `-n auto --dist loadgroup`) each stays on one worker
# instead of paying its fixtures once per worker.
_ONE_WORKER_FILES = ("test_ring_attention.py", "test_bench_harness.py", "test_compile_sm90.py",
                     "test_varlen_transformers.py")


def _compile_session(config) -> bool:
    expr = config.option.markexpr or ""
    return "sm90_compile" in expr and "not sm90_compile" not in expr


_INTERPRETING_AT_START: list = []


def pytest_configure(config):
    if not torch.cuda.is_available() and not _compile_session(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _INTERPRETING_AT_START.append(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # Each worker gets its share of the cores: n workers x all cores oversubscribes (CI: 2 cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads xdist_group into node ids
def pytest_collection_modifyitems(config, items):
    # The session's setting, not what a module imported during collection may have set since: a
    # test module that turned the interpreter on silently skipped every sm90 test once (2026-11-27).
    interpreting = _INTERPRETING_AT_START[-1]
    if interpreting != (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
        raise pytest.UsageError(
            "a test module changed TRITON_INTERPRET while being collected (it imports, at module level, a "
            "benchmark script that sets it): kernels imported since are built for the wrong mode. Import that "
            "script inside the test or fixture that needs it.")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    skip_compile = pytest.mark.skip(
        reason="compile-only sm90 tests need a session without TRITON_INTERPRET: run "
               "`pytest -m sm90_compile` (make test does)")
    for item in items:
        if item.path.name in _ONE_WORKER_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "sm90_compile" in item.keywords and interpreting:
            item.add_marker(skip_compile)


@pytest.fixture
def fresh_compiles():
    """Every compile in the test really lowers (and records its sites): Dynamo starts empty and
    Inductor's and AOT autograd's on-disk caches are off, since a cache hit skips lowering."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import fa3_inductor

    torch._dynamo.reset()
    fa3_inductor.clear_lowered_sites()
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def cpu_kernels():
    """Skip unless our kernels run on CPU tensors here (Triton's interpreter is on)."""
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("CPU runs of our kernel need TRITON_INTERPRET=1 (conftest sets it without CUDA)")


@pytest.fixture
def our_kernels():
    """Skip unless our kernels can run at all here (a CUDA device, or the interpreter)."""
    from triton import knobs

    if not knobs.runtime.interpret and not torch.cuda.is_available():
        pytest.skip("our kernels need CUDA or TRITON_INTERPRET=1")
