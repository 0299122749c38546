"""What an FP8 attention call does to its inputs: the recipe (Q/K format, Hadamard, block sizes,
smoothing, two-level accumulation, seed) and the RoPE that the prologue fuses.

Plain records with no behaviour, below the front doors, the lowering and the kernel families, which
all read them: ``fa3_inductor.flex(..., fp8=FP8Recipe(...))`` hands one down, the prologue
(templates/fp8_prologue/) follows it, and the FP8 forward kernel reads the block sizes back.

The method (FlashAttention-3 paper, §3.3 and §4.3) in one paragraph: Q and K are multiplied by the
same random orthogonal matrix H·diag(±1)/√d_b (d_b: a Hadamard block, a power of two dividing D),
which leaves QKᵀ unchanged and spreads outliers over the head dim ("incoherent processing"); then Q,
K and V are quantized to e4m3 with one scale per kernel tile ("block quantization"), V written
transposed (Vᵀ: FP8 wgmma needs its B operand K-major). Subtracting K's mean over tokens
(smoothing) adds a per-query constant to every score, which softmax ignores.

One departure by default (``qk="int8"``): Q and K are quantized to int8 (amax/127 per block, after
the same rotation) and QKᵀ runs as an s8·s8→s32 MMA, while P and V stay e4m3 (SageAttention2's
split). On real activations the e4m3 rounding of Q and K is ~89% of the FP8 error; int8 steps are
~3× finer there and its sums exact (docs/fp8_accuracy.md, "Error budget on real activations").
H100 runs int8 and e4m3 MMA at the same rate on one-byte operands. ``qk="e4m3"`` is the paper's form.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0   # largest finite float8_e4m3fn
INT8_MAX = 127.0   # int8 Q / K are symmetric: [-127, 127] (-128 unused)
QK_FORMATS = ("int8", "e4m3")


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """How an FP8 forward quantizes its inputs. ``FP8Recipe()`` is the shipped default.

    - ``hadamard``: rotate Q and K by the seeded random-sign Hadamard matrix first.
    - ``block_m`` / ``block_n``: rows of Q / of K and V sharing one scale (the kernel's tiles;
      0 means one scale per (batch, head), the per-head ablation).
    - ``smooth_k``: subtract K's mean over tokens (per batch, head and channel) before quantizing,
      taken over a stratified sample of at most 256 tokens (exact under softmax for any vector).
    - ``two_level``: PV partial sums kept in the tensor core's accumulator for this many KV tiles,
      then added into an fp32 accumulator (Hopper's FP8 MMA accumulates in about 22 bits). 0: one
      accumulator for the whole row (the ablation). The kernels add every tile (1, the default) or
      never (0); intervals above one tile are benchmarks/fp8_accuracy.py's emulation only, and the
      front doors (:meth:`of`) refuse them.
    - ``seed``: the random signs of the Hadamard matrix.
    - ``qk``: the format of Q and K. "int8" (default): int8 with scale amax/127 per block (round
      half to even), QKᵀ an int8 MMA with exact int32 sums; "e4m3": FlashAttention-3's
      float8_e4m3fn with scale amax/448 (the paper's method, and the ablation). P and V are e4m3
      either way.

    Example::

        >>> FP8Recipe(smooth_k=True).block_m
        128
        >>> FP8Recipe.of(True) == FP8Recipe()
        True
        >>> FP8Recipe().qk, FP8Recipe(qk="e4m3").qk_max
        ('int8', 448.0)
    """

    hadamard: bool = True
    block_m: int = 128
    block_n: int = 128
    smooth_k: bool = False
    two_level: int = 1
    seed: int = 0
    qk: str = "int8"     # last: positional callers of the older fields keep working

    def __post_init__(self) -> None:
        if self.qk not in QK_FORMATS:
            raise ValueError(f"FP8Recipe.qk must be 'int8' (Q, K in int8, the default) or 'e4m3' "
                             f"(FlashAttention-3's Q, K in e4m3), got {self.qk!r}")
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size != 0 and (size < 16 or size & (size - 1)):
                raise ValueError(f"FP8Recipe.{name} must be 0 (per head) or a power of two >= 16, "
                                 f"got {size}")
        if self.two_level < 0:
            raise ValueError(f"FP8Recipe.two_level must be >= 0 (0 turns it off), got {self.two_level}")

    @property
    def qk_max(self) -> float:
        """The largest quantized magnitude of Q and K: a block's scale is its amax over this.

        Example::

            >>> FP8Recipe().qk_max
            127.0
        """
        return INT8_MAX if self.qk == "int8" else E4M3_MAX

    @staticmethod
    def of(fp8: "bool | FP8Recipe | None") -> Optional["FP8Recipe"]:
        """The recipe an ``fp8=`` argument asks for: None for False / None, the default for True.

        Example::

            >>> FP8Recipe.of(False) is None
            True
        """
        if fp8 is None or fp8 is False:
            return None
        if fp8 is True:
            return _DEFAULT   # frozen: one shared instance (built and validated once, not per call)
        if isinstance(fp8, FP8Recipe):
            if fp8.two_level > 1:
                raise ValueError(
                    f"fp8=FP8Recipe(two_level={fp8.two_level}): the FP8 kernels add each KV tile's PV sum into "
                    "fp32 (two_level=1, the default) or keep one accumulator for the row (two_level=0); "
                    "intervals above one tile exist only in benchmarks/fp8_accuracy.py's emulation (in the "
                    "Hopper kernel they cost registers and measured slower: docs/design/hopper_fp8.md, 'PV under "
                    "the next softmax'). Pass two_level=1 or 0")
            return fp8
        raise TypeError(f"fp8 must be True, False or an fa3_inductor.FP8Recipe, got {type(fp8).__name__}")

    def check_score_mod(self, score_mod: Any, caller: str) -> None:
        """Refuse ``smooth_k`` with a score_mod (``caller`` names the entry point in the message).

        Example::

            >>> FP8Recipe().check_score_mod(lambda s, b, h, q, kv: s, "flex")  # no smoothing: fine
        """
        if self.smooth_k and score_mod is not None:
            raise ValueError(f"{caller}(fp8=FP8Recipe(smooth_k=True)) with a score_mod: subtracting "
                             "K's mean shifts each query's scores by a constant, which softmax "
                             "ignores but a score_mod does not; use smooth_k=False with a score_mod")


_DEFAULT = FP8Recipe()


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding for the prologue to apply to Q and K before the Hadamard rotation.

    ``cos`` / ``sin``: tables of shape [P, R] (or [B, P, R]) in the model's convention, R <= D the
    rotated width (channels past R pass through); any values, each channel rotated by its own
    column: x·cos + rotate(x)·sin. ``style``: "half" (rotate_half: channel i pairs with i + R/2;
    out[i] = x[i]·cos[i] - x[i+R/2]·sin[i], out[i+R/2] = x[i+R/2]·cos[i+R/2] + x[i]·sin[i+R/2])
    or "interleaved" (channel 2i pairs with 2i + 1; out[2i] = x[2i]·cos[2i] - x[2i+1]·sin[2i],
    out[2i+1] = x[2i+1]·cos[2i+1] + x[2i]·sin[2i+1]). Models' tables repeat each frequency over
    the two channels of a pair (as :meth:`from_theta` builds them); nothing requires it.
    ``q_positions`` / ``k_positions``: int tensors [M] / [N] (or [B, M] / [B, N]) selecting table
    rows; None means 0, 1, 2, ...

    Example::

        >>> import torch
        >>> angles = torch.arange(16.0)[:, None] * torch.rand(64)   # 64 frequencies, no repeat
        >>> RopeSpec(angles.cos(), angles.sin(), style="half").style
        'half'
    """

    cos: object
    sin: object
    style: str = "half"
    q_positions: object = None
    k_positions: object = None

    def __post_init__(self) -> None:
        if self.style not in ("half", "interleaved"):
            raise ValueError(f"RopeSpec.style must be 'half' or 'interleaved', got {self.style!r}")

    @staticmethod
    def from_theta(dim: int, length: Optional[int] = None, *, theta: float = 10000.0,
                   style: str = "half", q_positions: object = None, k_positions: object = None,
                   device: object = None) -> "RopeSpec":
        """Float32 tables [length, dim] of the standard RoPE frequencies theta^(-2i/dim), computed
        in float64 on the host (rows are positions 0 .. length-1), each frequency on both channels
        of its pair (columns i and i + dim/2 for "half", 2i and 2i + 1 for "interleaved"). ``length`` None: one past the
        largest position given (reads the positions back: a device sync on a GPU).

        Example::

            >>> r = RopeSpec.from_theta(64, 4096, theta=10000.0, style="interleaved")
            >>> tuple(r.cos.shape), r.cos.dtype
            ((4096, 64), torch.float32)
        """
        import torch

        if dim <= 0 or dim % 2:
            raise ValueError(f"RopeSpec.from_theta: dim must be a positive even number, got {dim}")
        if length is None:
            given = [p for p in (q_positions, k_positions) if p is not None]
            if not given:
                raise ValueError("RopeSpec.from_theta: pass length (the table's rows) or positions")
            length = 1 + max(int(p.max()) for p in given)
        pos = torch.arange(length, dtype=torch.float64)
        inv_freq = torch.pow(float(theta), -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = pos[:, None] * inv_freq[None, :]
        if style == "half":
            angles = torch.cat([angles, angles], dim=-1)
        else:
            angles = angles.repeat_interleave(2, dim=-1)
        return RopeSpec(angles.cos().float().to(device), angles.sin().float().to(device), style,
                        q_positions, k_positions)


@dataclasses.dataclass
class FP8Operands:
    """What the FP8 prologue (templates/fp8_prologue/) hands the FP8 forward kernel.

    - ``q`` [B, Hq, M, D], ``k`` [B, Hkv, N, D]: contiguous, after RoPE and the Hadamard rotation
      (and, for K, the mean subtraction when ``recipe.smooth_k``); torch.int8 in [-127, 127] when
      ``recipe.qk == "int8"``, float8_e4m3fn when "e4m3".
    - ``vt`` [B, Hkv, Dv, N_pad]: float8_e4m3fn, V quantized and transposed (tokens last,
      contiguous); N_pad is N rounded up to a multiple of 16 (16-byte TMA row strides); the pad
      columns are 0.
    - ``q_scale`` [B, Hq, ceil(M / block_m)], ``k_scale`` / ``v_scale`` [B, Hkv, ceil(N / block_n)]
      float32: q[b, h, i, :].float() * q_scale[b, h, i // block_m] is the dequantized row (block
      size 0: one scale per head, last dim 1). Q / K scales are amax / ``recipe.qk_max`` (127 or
      448); V's are powers of two at or above amax / 448. An all-zero block has scale 1.
    - ``v_scale_max`` [B, Hkv]: the largest v_scale among blocks that are not all zero (1 when all
      are), for the forward kernel to fold v_scale / v_scale_max into P.
    - ``k_mean`` [B, Hkv, D] float32: the mean subtracted from the rotated K (``smooth_k``), else None.
    - ``n``: N, the number of real tokens (``vt`` is padded).
    """

    q: "torch.Tensor"
    k: "torch.Tensor"
    vt: "torch.Tensor"
    q_scale: "torch.Tensor"
    k_scale: "torch.Tensor"
    v_scale: "torch.Tensor"
    v_scale_max: "torch.Tensor"
    k_mean: "Optional[torch.Tensor]"
    recipe: FP8Recipe
    n: int
