"""Hopper (sm90) FlashAttention-3-structure backward (Gluon), issue 19: first in the registry's
backward families (family.py), design in docs/design/hopper_backward.md.

bwd_sm90.py (kernels; bwd_sm90_wide.py for head dims 256 and 192 / 128; bwd_sm90_k96.py for 192 / 128 without a
mask, 96-key tiles; bwd_sm90_m128.py for D = 64 with 128 query rows a step, configs.VARIANTS m128), host.py (launch preparation,
compile-only path, the gl score_mod derivative), configs.py (tile table), family.py (the backward-family
interface).
"""
from .configs import SUPPORTED_HEAD_DIM_PAIRS, SUPPORTED_HEAD_DIMS, BwdSm90Config, get_bwd_config
from .host import (compile_hopper_backward, launch_hopper_backward, prepare_hopper_backward,
                   score_grad_gl)

__all__ = ["SUPPORTED_HEAD_DIMS", "SUPPORTED_HEAD_DIM_PAIRS", "BwdSm90Config", "get_bwd_config",
           "compile_hopper_backward", "launch_hopper_backward", "prepare_hopper_backward", "score_grad_gl"]
