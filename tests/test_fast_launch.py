"""The launch cache's argument recipe (runtime/fast_launch.py), without a GPU.

A stand-in JIT function and kernel record what would be launched, so these check the recipe:
which arguments are the new call's tensors, which descriptors are rebuilt over them, what
stays constant, and which launches must not be cached at all.
"""

from __future__ import annotations

import dataclasses
import inspect

import types

import pytest
import torch

from fa3_inductor.runtime import fast_launch


@dataclasses.dataclass
class Descriptor:  # the shape of triton's host TensorDescriptor dataclasses
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list


class FakeKernel:
    def __init__(self):
        self.launches = []
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), args))

    def launch_metadata(self, grid, stream, *args):
        return None


class FakeJit:
    def __init__(self, fn):
        self.params = [_Param(p) for p in inspect.signature(fn).parameters.values()]
        self.kernel = FakeKernel()
        self.first_calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.first_calls.append((grid, args, kwargs))
            return self.kernel
        return launch


class _Param:
    def __init__(self, p):
        self.name, self.default = p.name, p.default
        self.has_default = p.default is not inspect.Parameter.empty


def kernel_signature(x_desc, y, bufs, placeholder, n, scale, BLOCK=64, FLAG=False):
    pass


@pytest.fixture(autouse=True)
def no_stream(monkeypatch, request):
    fast_launch.clear()
    if request.node.get_closest_marker("gpu") is None:  # the stand-in kernels need no stream
        monkeypatch.setattr(fast_launch, "current_stream", lambda device: 0)
    yield
    fast_launch.clear()


def _inputs():
    x, y, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(3)
    return [x, y, b]


def _prepare(jit, inputs):
    x, y, b = inputs
    args = (Descriptor(x, list(x.shape), list(x.stride()), [2, 8]), y, (b,),
            torch.zeros(1, dtype=torch.int32), x.shape[0], 0.5)
    return lambda: (jit, args, {"BLOCK": 32}, (3, 2), "tag")


def test_second_call_substitutes_the_new_tensors():
    jit = FakeJit(kernel_signature)
    first, second = _inputs(), _inputs()
    key = ("k", fast_launch.tensor_signature(first))
    assert fast_launch.launch_cached(key, first, _prepare(jit, first)) == "tag"
    assert fast_launch.launch_cached(key, second, lambda: pytest.fail("prepare ran")) == "tag"
    assert len(jit.first_calls) == 1
    (grid, args), = jit.kernel.launches
    desc, y, bufs, placeholder, n, scale, block, flag = args
    assert grid == (3, 2, 1)
    assert desc.base is second[0] and desc.block_shape == [2, 8] and desc.shape == [4, 8]
    assert y is second[1] and bufs[0] is second[2]
    assert placeholder.numel() == 1 and (n, scale, block, flag) == (4, 0.5, 32, False)


def test_recipe_keeps_no_reference_to_the_first_tensors():
    import gc
    import weakref

    jit = FakeJit(kernel_signature)
    first = _inputs()
    refs = [weakref.ref(t) for t in first]
    fast_launch.launch_cached(("k",), first, _prepare(jit, first))
    jit.first_calls.clear()
    del first
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_derived_tensor_makes_the_launch_uncacheable():
    jit = FakeJit(kernel_signature)
    first = _inputs()
    x, y, b = first
    copy = y.t().contiguous().t()  # e.g. a contiguous copy made while preparing: not an input
    args = (Descriptor(x, [4, 8], [8, 1], [2, 8]), copy, (b,), torch.zeros(1), 4, 0.5)
    prepare = lambda: (jit, args, {}, (1,), "tag")  # noqa: E731
    fast_launch.launch_cached(("u",), first, prepare)
    fast_launch.launch_cached(("u",), first, prepare)
    assert len(jit.first_calls) == 2 and not jit.kernel.launches


def test_descriptors_are_encoded_once_per_address(monkeypatch):
    """Where the C launcher is reachable (_compat.c_launcher), a descriptor argument is encoded on the first
    launch at an address and taken from the entry's cache after that; a new address encodes anew, every
    launch gets the encoding of its own address, and input tensors go to the launcher as their addresses."""
    from fa3_inductor._compat import CLauncher

    encodings, launches = [], []

    def expand(desc, meta):
        encodings.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta), *desc.shape, *desc.strides]

    direct = CLauncher(lambda *a: launches.append(a), False, False, {0: "meta0"}, expand)
    monkeypatch.setattr(fast_launch, "c_launcher", lambda kernel: direct)
    jit = FakeJit(kernel_signature)
    a, b = _inputs(), _inputs()
    key = ("d", fast_launch.tensor_signature(a))
    fast_launch.launch_cached(key, a, _prepare(jit, a))      # the first launch: JIT path, nothing encoded
    for inputs in (a, b, a, b):
        fast_launch.launch_cached(key, inputs, lambda: pytest.fail("prepare ran"))
    assert encodings == [a[0].data_ptr(), b[0].data_ptr()]
    assert [call[13][1] for call in launches] == [t[0].data_ptr() for t in (a, b, a, b)]
    first = launches[-1]
    assert first[:3] == (3, 2, 1) and first[13:18] == (("map", b[0].data_ptr(), "meta0"), 4, 8, 8, 1)
    assert first[18] == b[1].data_ptr() and first[19][0] is b[2]   # the arguments after the descriptor


def test_direct_args_mark_the_per_call_places_in_argument_order():
    """The C launcher's argument list is laid out once: the launch head, then the kernel's arguments in
    order, constants in place and None where an input, a per-call tuple or a descriptor's encoding (its
    width taken from the first call's, which is kept) goes; a metadata slot that holds no descriptor makes
    the direct path unusable."""
    from fa3_inductor._compat import CLauncher

    x, y, b = _inputs()
    desc = ("descriptor", 0, Descriptor, dict(shape=[4, 8], strides=[8, 1], block_shape=[2, 8]))
    recipe = (desc, ("input", 1), ("tuple", (("input", 2),)), ("const", 7), ("const", 0.5), ("const", None))
    direct = CLauncher(None, False, True, {0: "m"},
                                lambda d, meta: [("map", d.base.data_ptr()), *d.shape, *d.strides])
    kernel = types.SimpleNamespace(function="fn", packed_metadata="pm")
    seed = {}
    args = fast_launch._DirectArgs.of(kernel, (3, 2, 1), recipe, direct, (x, y, b), seed)
    head = fast_launch._HEAD
    assert args.template[:head] == [3, 2, 1, None, "fn", False, True, None, None, "pm", None, None, None]
    assert args.template[head:] == [None] * 5 + [None, None, 7, 0.5, None]
    assert args.descriptors == ((head, 5, 0, 0, desc, "m"),)
    assert args.inputs == ((head + 5, 1),) and args.built == ((head + 6, ("tuple", (("input", 2),))),)
    assert seed == {(0, x.data_ptr()): [("map", x.data_ptr()), 4, 8, 8, 1]}
    no_descriptor = direct._replace(descriptor_meta={3: "m"})
    with pytest.raises(fast_launch._Uncacheable):
        fast_launch._DirectArgs.of(kernel, (3, 2, 1), recipe, no_descriptor, (x, y, b), {})


def _prepare_flat(jit, inputs):   # no tuple argument: nothing is built per call
    x, y, _ = inputs
    args = (Descriptor(x, list(x.shape), list(x.stride()), [2, 8]), y, (), torch.zeros(1), 4, 0.5)
    return lambda: (jit, args, {}, (1,), "tag")


def test_argument_tuples_are_kept_per_address(monkeypatch):
    """A repeat at the same (stream, input addresses) launches the kept argument tuple, built nothing anew;
    new addresses build a new tuple; the kept tuples hold addresses, never the callers' tensors."""
    import gc
    import weakref

    from fa3_inductor._compat import CLauncher

    launches, builds = [], []
    direct = CLauncher(lambda *a: launches.append(a), False, False, {0: "meta0"},
                       lambda desc, meta: [("map", desc.base.data_ptr()), *desc.shape, *desc.strides])
    monkeypatch.setattr(fast_launch, "c_launcher", lambda kernel: direct)
    build = fast_launch._DirectArgs.build
    monkeypatch.setattr(fast_launch._DirectArgs, "build",
                        lambda self, *a: builds.append(1) or build(self, *a))
    jit = FakeJit(kernel_signature)
    a, b = _inputs(), _inputs()
    key = ("flat", fast_launch.tensor_signature(a))
    fast_launch.launch_cached(key, a, _prepare_flat(jit, a))
    for inputs in (a, a, b, a, b):
        fast_launch.launch_cached(key, inputs, lambda: pytest.fail("prepare ran"))
    assert len(builds) == 2 and len(launches) == 5
    assert [call[13][1] for call in launches] == [t[0].data_ptr() for t in (a, a, b, a, b)]
    assert [call[18] for call in launches] == [t[1].data_ptr() for t in (a, a, b, a, b)]
    refs = [weakref.ref(t) for t in (*a, *b)]
    jit.first_calls.clear()   # the stand-in JIT's own record of the first call
    del a, b, inputs
    gc.collect()
    assert all(r() is None for r in refs)


def test_signature_tells_alignment_and_layout_apart():
    base = torch.randn(64)
    a, b = base[:32], base[1:33]
    assert fast_launch.tensor_signature([a]) != fast_launch.tensor_signature([b])
    assert (fast_launch.tensor_signature([torch.zeros(4, 8)])
            != fast_launch.tensor_signature([torch.zeros(8, 4).t()]))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [96, 128])
def test_cache_hits_alternating_between_live_inputs(D):
    """Two sets of inputs alive at once, called in turn: each hit launches with its own addresses' TMA
    descriptors (encoded once per address by the direct launch path), never the other set's."""
    from reference import assert_matches_reference, reference_attention

    import fa3_inductor

    fast_launch.clear()
    sets = [[torch.randn(1, 4, 384, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    refs = [reference_attention(q, k, v, None, None)[0] for q, k, v in sets]
    for i in (0, 1, 0, 1, 1, 0):
        out = fa3_inductor.flex(*sets[i], template="hopper")
        assert_matches_reference(out, refs[i], torch.bfloat16)
    entries = [e for e in fast_launch._CACHE.values() if e.tag == "hopper"]
    assert entries and all(e.direct is not None for e in entries), "the direct launch path was not taken"
    assert all(len({p for p, _ in e.encoded}) >= 4 for e in entries)


@pytest.mark.gpu
@pytest.mark.parametrize("template", ["auto", "generic"])
def test_cache_hits_compute_on_the_new_inputs(template):
    """Same shapes, new tensors (and a (B, S, H, D) layout): every call is right, not only the first."""
    from reference import assert_matches_reference, reference_attention

    import fa3_inductor
    from fa3_inductor import mods

    fast_launch.clear()
    for layout in ("bhsd", "bshd", "bhsd"):
        for _ in range(2):
            if layout == "bshd":
                q, k, v = (torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
                           .transpose(1, 2) for _ in range(3))
            else:
                q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
            out = fa3_inductor.flex(q, k, v, score_mod=mods.softcap(20.0), mask_mod=mods.causal,
                                    template=template)
            ref, _ = reference_attention(q, k, v, mods.softcap(20.0), mods.causal)
            assert_matches_reference(out, ref, torch.bfloat16)
    assert fast_launch._CACHE, "the launch cache was never used"


def test_a_tensor_at_two_places_keys_its_own_launch():
    """A recording made where one tensor fills two places (flex(q, q, q)) finds both by identity:
    replayed for distinct tensors it would hand one input in another's place. The forward op's key
    tells the two apart (aliasing), as the backward's does."""
    from fa3_inductor.runtime.ops import _launch_key

    x, y, z = _inputs()
    assert fast_launch.aliasing([x, y, None, z]) is None
    assert fast_launch.aliasing([x, x, None, y]) == (0, 0, None, 3)
    distinct = _launch_key("{}", 0.5, 128, 128, 0, (x, y, z))
    assert _launch_key("{}", 0.5, 128, 128, 0, (x, x, z)) != distinct
    assert _launch_key("{}", 0.5, 128, 128, 0, (y, x, z)) == distinct
