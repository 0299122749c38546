"""timm and diffusers families for the coverage harness (benchmarks/coverage.py).

timm: every model module of ``timm.models`` whose source names an attention class, SDPA or a
softmax is one family; its model is the smallest-named of ``timm.list_models(module=...)``
built with the first of :data:`TIMM_SHAPES` it accepts (tiny images, 2 blocks, 4 heads of 16).
timm imports torchvision at import time (FrozenBatchNorm2d, its data transforms), and PyPI's
torchvision does not import beside the CPU torch 2.13 wheel. Where torchvision imports (the GPU
machines have one built for their torch) timm uses it; where it is missing or fails to import,
timm is imported against stand-in torchvision modules whose names raise Excluded if a model ever
instantiates one (none of the attention models here does), removed from ``sys.modules`` right
after the import.

diffusers: the denoisers and the VAE whose blocks attend (UNet with cross-attention, DiT, PixArt,
SD3, Flux, the VAE's mid-block), each with its default processor (``AttnProcessor2_0``: SDPA)
and with the classic ``AttnProcessor`` (``baddbmm`` + softmax + ``bmm`` over merged batch×heads).

Example::

    >>> [name for name, build in timm_families()][:3]        # doctest: +SKIP
    ['beit', 'cait', 'coat']
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import traceback
import types
from typing import Any, Callable

import torch

BATCH, IMAGE = 2, 32
# Tried in order until one builds and runs: flat ViTs, then hierarchical ones, then defaults at
# a small image, then the defaults.
TIMM_SHAPES: tuple[dict[str, Any], ...] = (
    dict(img_size=IMAGE, patch_size=8, depth=2, embed_dim=64, num_heads=4),
    dict(img_size=IMAGE, patch_size=2, depths=(1, 1), embed_dim=32, num_heads=(2, 4),
         window_size=4),
    dict(img_size=64, depths=(1, 1, 1, 1)),
    dict(img_size=64),
    dict(),
)


class Excluded(Exception):
    """The family cannot be built tiny here; the message is the reason listed for it."""


_TORCHVISION_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                        "torchvision.datasets", "torchvision.ops", "torchvision.ops.misc",
                        "torchvision.models", "torchvision.models.feature_extraction",
                        "torchvision.utils")


class _StandInType(type):
    """A torchvision name timm imports but the models built here never use: any attribute of it
    is another stand-in, and making one raises Excluded with the reason."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInType(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise Excluded(f"this timm model uses torchvision's {cls.__name__}; torchvision does not "
                       "import beside this torch")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInType(name, (), {})


def _import_timm() -> Any:
    """timm, against the real torchvision where that imports (the GPU machines have one built
    for their torch), else against the stand-ins."""
    try:
        return importlib.import_module("timm")
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            raise Excluded(f"timm does not import: {exc} (pip install --no-deps timm; it needs "
                           "Pillow)") from None
    except Exception as exc:   # a torchvision built for another torch raises on import
        if "torchvision" not in "".join(traceback.format_exception(exc)):
            raise Excluded(f"timm does not import: {type(exc).__name__}: {exc}") from None
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]   # a half-imported torchvision
    stand_in = {name: _StandInModule(name) for name in _TORCHVISION_MODULES}
    for name, module in stand_in.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(stand_in[parent], child, module)
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        del sys.modules[name]
    sys.modules.update(stand_in)
    try:
        return importlib.import_module("timm")
    finally:
        for name in stand_in:
            sys.modules.pop(name, None)


def timm_families() -> list[tuple[str, Callable[..., tuple[torch.nn.Module, dict]]]]:
    """(family, build) for every timm model module whose source mentions attention or softmax.

    Example::

        >>> dict(timm_families())["vision_transformer"]()   # doctest: +SKIP
    """
    try:
        timm = _import_timm()
    except Excluded as exc:
        reason = str(exc)

        def unavailable(*_: Any, **__: Any) -> tuple:
            raise Excluded(reason)
        return [("timm", unavailable)]
    out = []
    for module in sorted(set(timm.list_modules())):
        try:
            source = inspect.getsource(importlib.import_module(f"timm.models.{module}"))
        except (ImportError, OSError, TypeError):
            continue
        if not re.search(r"Attention\b|VisionTransformer\b|scaled_dot_product_attention|softmax", source):
            continue
        names = timm.list_models(module=module)
        if not names:
            continue
        out.append((module, lambda realistic=False, batch=None, seq=None, names=names, module=module:
                    build_timm(module, names, realistic, batch or BATCH)))
    return out


def _smallest(names: list[str]) -> list[str]:
    size = ("pico", "nano", "atto", "femto", "tiny", "xxs", "xs", "small", "s")
    def key(n: str) -> tuple:
        for i, s in enumerate(size):
            if re.search(rf"(^|_){s}(\d|_|$)", n):
                return (i, len(n), n)
        return (len(size), len(n), n)
    return sorted(names, key=key)


def build_timm(module: str, names: list[str], realistic: bool, batch: int
               ) -> tuple[torch.nn.Module, dict]:
    """The first model of ``module`` that builds at one of :data:`TIMM_SHAPES` and runs."""
    timm = _import_timm()
    errors = []
    for name in _smallest(names)[:2]:
        for shape in ((dict(),) if realistic else TIMM_SHAPES):
            try:
                torch.manual_seed(0)
                model = timm.create_model(name, pretrained=False, num_classes=0, **shape).eval()
                size = shape.get("img_size") or _default_size(model)
                channels = getattr(model, "in_chans", 3)
                x = torch.randn(batch, channels, size, size,
                                generator=torch.Generator().manual_seed(1))
                with torch.no_grad():
                    model(x)
                return model, {"x": x}
            except Excluded:
                raise
            except Exception as exc:
                errors.append(f"{name} {shape or 'defaults'}: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}")
    raise Excluded("no tiny shape builds: " + " | ".join(errors[-2:]))


def _default_size(model: torch.nn.Module) -> int:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size", (3, 224, 224))
    return int(size[-1])


# ------------------------------------------------------------------------------------------
# diffusers
# ------------------------------------------------------------------------------------------

def _unet(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=2, norm_num_groups=8)   # heads = channels / 2 ... head dim 16 / 32
    gen = torch.Generator().manual_seed(1)
    return model, dict(sample=torch.randn(BATCH, 4, 16, 16, generator=gen),
                       timestep=torch.tensor(10), encoder_hidden_states=torch.randn(
                           BATCH, 8, 32, generator=gen))


def _dit(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                    num_layers=2, sample_size=8, patch_size=2, norm_num_groups=8,
                                    num_embeds_ada_norm=10)
    gen = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(BATCH, 4, 8, 8, generator=gen),
                       timestep=torch.tensor([3, 5]), class_labels=torch.tensor([1, 2]))


def _pixart(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.PixArtTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                       out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                       cross_attention_dim=64, caption_channels=32)
    gen = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(BATCH, 4, 8, 8, generator=gen),
                       encoder_hidden_states=torch.randn(BATCH, 8, 32, generator=gen),
                       timestep=torch.tensor([3, 5]),
                       added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def _sd3(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                    attention_head_dim=16, num_attention_heads=4,
                                    joint_attention_dim=32, caption_projection_dim=64,
                                    pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    gen = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(BATCH, 4, 8, 8, generator=gen),
                       encoder_hidden_states=torch.randn(BATCH, 8, 32, generator=gen),
                       pooled_projections=torch.randn(BATCH, 16, generator=gen),
                       timestep=torch.tensor([3, 5]))


def _flux(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1,
                                     num_single_layers=1, attention_head_dim=16,
                                     num_attention_heads=4, joint_attention_dim=32,
                                     pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    gen = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(BATCH, 16, 16, generator=gen),
                       encoder_hidden_states=torch.randn(BATCH, 8, 32, generator=gen),
                       pooled_projections=torch.randn(BATCH, 16, generator=gen),
                       timestep=torch.tensor([0.3, 0.5]), img_ids=torch.zeros(16, 3),
                       txt_ids=torch.zeros(8, 3))


def _vae(d: Any) -> tuple[torch.nn.Module, dict]:
    model = d.AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                            down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                            norm_num_groups=8, layers_per_block=1, sample_size=16)
    return model, dict(sample=torch.randn(BATCH, 3, 16, 16,
                                          generator=torch.Generator().manual_seed(1)))


DIFFUSERS = {"unet2d-condition": _unet, "dit": _dit, "pixart": _pixart, "sd3": _sd3,
             "flux": _flux, "autoencoder-kl": _vae}


def diffusers_families() -> list[tuple[str, Callable[..., tuple[torch.nn.Module, dict]]]]:
    """(family, build) for each diffusers model in :data:`DIFFUSERS`, once with its default
    attention processor and once with the classic ``AttnProcessor`` ("<name>/classic").

    Example::

        >>> dict(diffusers_families())["dit"]()   # doctest: +SKIP
    """
    out = []
    for name, make in DIFFUSERS.items():
        for classic in (False, True):
            out.append((name + ("/classic" if classic else ""),
                        lambda realistic=False, batch=None, seq=None, make=make, classic=classic:
                        build_diffusers(make, classic)))
    return out


def build_diffusers(make: Callable[[Any], tuple[torch.nn.Module, dict]], classic: bool
                    ) -> tuple[torch.nn.Module, dict]:
    """Build one diffusers model (float32, eval), optionally with the classic processor."""
    try:
        d = importlib.import_module("diffusers")
    except ImportError as exc:
        raise Excluded(f"diffusers is not installed ({exc}); pip install diffusers") from None
    torch.manual_seed(0)
    try:
        model, inputs = make(d)
    except Exception as exc:
        raise Excluded(f"does not build: {type(exc).__name__}: "
                       f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}") from None
    if classic:
        from diffusers.models.attention_processor import AttnProcessor

        if not hasattr(model, "set_attn_processor"):
            raise Excluded("no attention processors to set")
        try:
            model.set_attn_processor(AttnProcessor())
        except Exception as exc:
            raise Excluded(f"the classic AttnProcessor does not apply: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200]}") from None
    return model.float().eval(), inputs
