"""transformers families for the coverage harness (benchmarks/coverage.py): enumeration from
transformers' own auto mappings, tiny configs without downloads, and example inputs.

Every model type named in any ``MODEL_*_MAPPING_NAMES`` of ``transformers.models.auto`` is one
family. Its model is the base class (``MODEL_MAPPING_NAMES``), else the first task class that
names it. The config is the config class's defaults passed through :func:`shrink` (a generic
shrinker: hidden 64, 4 heads of 16, 2 layers, small vocab and images) and then
:data:`OVERRIDES` (the few families whose defaults the shrinker cannot make consistent).
Inputs follow the class's ``main_input_name``. A family that cannot be built this way raises
:class:`Excluded` with the reason, so it is listed, not dropped.

Example::

    >>> fam = hf_families()[0]                       # doctest: +SKIP
    >>> model, inputs = build_hf(fam, realistic=False)   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # no Hub look-ups (configs that name a checkpoint fail fast)

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 16, 128, 2, 256
BATCH, SEQ, DECODER_SEQ, IMAGE, PATCH = 2, 16, 8, 32, 8

# Attribute name -> tiny value, applied to every int attribute of that name in the config and
# its sub-configs (text_config, vision_config, ...). Names of one role share one value, so the
# sizes that must agree between sub-configs (a projector's in/out width) still agree.
_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "out_hidden_size",
                     "encoder_hidden_size", "decoder_hidden_size", "output_hidden_size", "dim",
                     "model_dim", "projector_hidden_size", "text_hidden_size",
                     "vision_hidden_size", "audio_hidden_size", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_attention_heads_encoder"), HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels",
                     "index_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM),
    "qk_rope_head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 32,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                     "mlp_dim", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "ffn_hidden_size", "intermediate_size_mlp"), FFN),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "num_encoder_layers", "depth"), LAYERS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
    "embedding_size": HIDDEN, "projection_dim": 32, "image_size": IMAGE, "patch_size": PATCH,
    "max_source_positions": 32, "num_queries": 8, "sliding_window": 8, "vocab_size": VOCAB,
    "num_key_value_heads": None,   # special-cased: GQA kept where the defaults have it
    "max_window_layers": LAYERS, "first_k_dense_replace": 1,
}
_LAYER_NAMES = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers", "depth")
_TOKEN_SUFFIXES = ("_token_id", "_token_index")

# Per family: attribute -> value (dotted for sub-configs), after the shrinker. Only where the
# generic rules give a config the model itself rejects, or sizes our kernels do not serve.
OVERRIDES: dict[str, dict[str, Any]] = {
    "swin": dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, patch_size=2),
    "swinv2": dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, patch_size=2),
    "donut-swin": dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, patch_size=2),
    "maskformer-swin": dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, patch_size=2),
    # XLM's width is emb_dim (2048, 16 heads): left at 2048 beside 4 heads, the head dim is 512
    "flaubert": dict(emb_dim=HIDDEN),
    "xlm": dict(emb_dim=HIDDEN),
}

# The realistic (timing) configs are the config classes' defaults with 2 layers, except where the
# defaults differ from the checkpoints people download in what the timed size needs. RoBERTa-style
# models count positions from padding_idx + 1, so their released checkpoints (roberta-base,
# xlm-roberta-base, microsoft/mpnet-base) have 514 position rows for 512 tokens; the config
# classes default to 512, which at 512 tokens indexes past the table (a device-side assert on
# CUDA, that poisons the process's CUDA context). build_hf also checks every position table.
REALISTIC_OVERRIDES: dict[str, dict[str, Any]] = {
    "roberta": dict(max_position_embeddings=514),
    "xlm-roberta": dict(max_position_embeddings=514),
    "mpnet": dict(max_position_embeddings=514),
}


class Excluded(Exception):
    """The family cannot be built tiny here; the message is the reason listed for it."""


def hf_families() -> list[str]:
    """Every model type in transformers' auto model mappings, sorted.

    Example::

        >>> "llama" in hf_families()   # doctest: +SKIP
        True
    """
    from transformers.models.auto import modeling_auto

    types: set[str] = set()
    for name in dir(modeling_auto):
        if name.startswith("MODEL") and name.endswith("_MAPPING_NAMES"):
            types |= set(getattr(modeling_auto, name))
    return sorted(types)


def model_class(model_type: str) -> type:
    """The class built for ``model_type``: the base model, else the first task model."""
    import transformers
    from transformers.models.auto import modeling_auto

    mappings = [modeling_auto.MODEL_MAPPING_NAMES] + [
        getattr(modeling_auto, n) for n in sorted(dir(modeling_auto))
        if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES")]
    for mapping in mappings:
        name = mapping.get(model_type)
        if name is None:
            continue
        name = name[0] if isinstance(name, (tuple, list)) else name
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError) as exc:
            raise Excluded(f"{name} does not import here: {_first_line(exc)}") from None
        if cls.forward is not torch.nn.Module.forward:   # (a container of sub-models has none)
            return cls
    raise Excluded(f"no model class with a forward for {model_type!r} in the auto mappings")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def shrink(config: Any, realistic: bool = False) -> Any:
    """A copy of ``config`` with every size set tiny (or, ``realistic``, only the layer count
    cut to 2), in place through sub-configs.

    Example::

        >>> shrink(transformers.LlamaConfig()).hidden_size   # doctest: +SKIP
        64
    """
    from transformers import PretrainedConfig

    config = copy.deepcopy(config)
    seen: set[int] = set()

    def walk(cfg: Any) -> None:
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        attrs = dict(vars(cfg))
        heads = attrs.get("num_attention_heads")
        free_ids = iter(range(VOCAB - 1, VOCAB - 33, -1))
        layers = {k: attrs[k] for k in _LAYER_NAMES if isinstance(attrs.get(k), int)}
        for key, value in attrs.items():
            if isinstance(value, PretrainedConfig):
                walk(value)
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            if realistic:
                if key in _LAYER_NAMES and value > LAYERS:
                    setattr(cfg, key, LAYERS)
                continue
            if key == "num_key_value_heads":
                grouped = isinstance(heads, int) and value < heads
                setattr(cfg, key, HEADS // 2 if grouped else HEADS)
            elif key in _SIZES and value > _SIZES[key]:
                setattr(cfg, key, _SIZES[key])
            elif key.endswith(_TOKEN_SUFFIXES) and value >= VOCAB - 32:
                # distinct ids at the tiny vocab's end (example ids stay below them)
                setattr(cfg, key, next(free_ids, VOCAB - 1))
        # Per-layer lists (layer_types, ...) follow the new layer count.
        new_layers = {k: getattr(cfg, k) for k in layers}
        for key, value in attrs.items():
            if isinstance(value, (list, tuple)) and key not in _SIZES:
                for name, old in layers.items():
                    if len(value) == old and new_layers[name] < old:
                        setattr(cfg, key, type(value)(value[:new_layers[name]]))
                        break

    walk(config)
    return config


def _set_dotted(config: Any, dotted: str, value: Any) -> None:
    obj = config
    *path, last = dotted.split(".")
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def hf_config(model_type: str, realistic: bool = False) -> Any:
    """The tiny (or realistic, 2-layer) config of ``model_type``; raises Excluded.

    Example::

        >>> hf_config("bert").hidden_size   # doctest: +SKIP
        64
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as exc:  # a config that needs a checkpoint, a package or sub-configs
        raise Excluded(f"default config does not build: {type(exc).__name__}: "
                       f"{_first_line(exc)}") from None
    config = shrink(config, realistic)
    overrides = (REALISTIC_OVERRIDES if realistic else OVERRIDES).get(model_type, {})
    for dotted, value in overrides.items():
        _set_dotted(config, dotted, value)
    for attr in ("use_cache", "return_dict"):
        if hasattr(config, attr):
            setattr(config, attr, attr == "return_dict")
    return config


def build_hf(model_type: str, realistic: bool = False, batch: int = BATCH, seq: int = SEQ
             ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The float32 model (random weights, eager attention where there is a choice, eval mode)
    and its example inputs; raises Excluded with the reason.

    Example::

        >>> model, inputs = build_hf("bert"); model(**inputs)   # doctest: +SKIP
    """
    cls = model_class(model_type)
    config = hf_config(model_type, realistic)
    torch.manual_seed(0)
    # eager attention, and MoE experts as plain matmuls (grouped_mm has no float64 reference)
    for kwargs in (dict(attn_implementation="eager", experts_implementation="eager"),
                   dict(attn_implementation="eager"), {}):
        try:
            model = cls._from_config(copy.deepcopy(config), **kwargs)
            break
        except Exception as exc:
            error = exc
    else:
        raise Excluded(f"{cls.__name__} does not build from the tiny config: "
                       f"{type(error).__name__}: {_first_line(error)}")
    model = model.float().eval()
    _check_position_tables(model, seq)
    candidates = example_inputs(model, config, batch, seq)
    for inputs in candidates[:-1]:
        try:
            with torch.no_grad():
                model(**inputs)
            return model, inputs
        except Exception:
            continue
    return model, candidates[-1]


def _check_position_tables(model: torch.nn.Module, seq: int) -> None:
    """Raise Excluded if the model's learned position table (an Embedding of the config's
    ``max_position_embeddings`` / ``n_positions`` rows) has fewer rows than ``seq`` tokens need,
    counting RoBERTa's offset (positions start at padding_idx + 1): an index past it is a
    device-side assert on CUDA, which breaks the process's CUDA context. (Other tables named
    for positions, DETR's object queries say, are not indexed by token positions.)

    Example::

        >>> model, _ = build_hf("roberta", realistic=True, seq=512)   # doctest: +SKIP
        >>> _check_position_tables(model, 513)                         # doctest: +SKIP
        Traceback (most recent call last):
        coverage_hf.Excluded: does not build at 513 tokens: ...
    """
    config = getattr(model, "config", None)
    rows = {getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")} - {None}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Embedding) or mod.num_embeddings not in rows or \
                not any(k in name.rsplit(".", 1)[-1] for k in ("pos", "wpe")):
            continue
        offset = mod.padding_idx + 1 if mod.padding_idx is not None else 0
        if seq + offset > mod.num_embeddings:
            raise Excluded(f"does not build at {seq} tokens: {name} has {mod.num_embeddings} "
                           f"positions, {seq} tokens need {seq + offset} (positions from {offset})")


def example_inputs(model: torch.nn.Module, config: Any, batch: int, seq: int) -> list[dict[str, Any]]:
    """Candidate inputs, richest first: the main input (``main_input_name``) with the other
    modality where the forward takes it too (ids and images for CLIP-like models), then the main
    input alone; decoder ids for encoder-decoders."""
    params = inspect.signature(model.forward).parameters
    name = getattr(model, "main_input_name", "input_ids")
    gen = torch.Generator().manual_seed(1)
    text = getattr(config, "text_config", None) or config
    vocab = getattr(text, "vocab_size", None) or VOCAB
    # ids below every special token (they sit at the vocab's end after shrink())
    ids = torch.randint(1, max(2, min(vocab, VOCAB) - 40), (batch, seq), generator=gen)
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", IMAGE)
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    pixels = torch.randn(batch, getattr(vision, "num_channels", 3), *size[-2:], generator=gen)
    if name == "input_ids":
        main = {name: ids}
    elif name == "pixel_values":
        main = {name: pixels}
    elif name == "input_values":
        if getattr(config, "model_type", "") == "audio-spectrogram-transformer":
            main = {name: torch.randn(batch, config.max_length, config.num_mel_bins, generator=gen)}
        else:
            main = {name: torch.randn(batch, 400 + 320 * seq, generator=gen)}
    elif name == "input_features":
        bins = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", seq)
        main = {name: torch.randn(batch, bins, frames, generator=gen)}
    else:
        raise Excluded(f"main input {name!r}: the harness builds ids, images, waveforms and "
                       "mel features only")
    if "decoder_input_ids" in params and name != "decoder_input_ids":
        decoder_vocab = getattr(config, "decoder_vocab_size", None) or vocab
        main["decoder_input_ids"] = torch.randint(1, max(2, min(decoder_vocab, VOCAB) - 40),
                                                  (batch, DECODER_SEQ), generator=gen)
    out = [main]
    other = {"input_ids": ids, "pixel_values": pixels}
    extra = {k: v for k, v in other.items() if k in params and k not in main}
    if extra and name in other:
        out.insert(0, {**main, **extra})
    return out


def kind_of(model: torch.nn.Module, inputs: dict[str, Any]) -> str:
    """"encoder", "decoder", "encoder-decoder", "vision", "audio" (for the table)."""
    config = getattr(model, "config", None)
    if "decoder_input_ids" in inputs or getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if "pixel_values" in inputs:
        return "vision"
    if "input_values" in inputs or "input_features" in inputs:
        return "audio"
    from transformers.models.auto import modeling_auto

    mt = getattr(config, "model_type", None)
    if mt in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder"
    return "decoder" if mt in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "encoder"
