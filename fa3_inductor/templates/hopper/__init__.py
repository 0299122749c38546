"""Hopper (sm90) FlashAttention-3-structure forward kernel (Gluon).

Public entry points:
  launch_fwd_sm90(q, k, v, out, lse, max_scores, *, sm_scale, score_mod=None, mask_mod=None,
                  score_bufs=(), mask_bufs=(), kv_num_blocks=None, kv_indices=None,
                  full_kv_num_blocks=None, full_kv_indices=None, sparse_q_block=128,
                  sparse_kv_block=128, config=None) -> None
  supports_sm90(q, k, v, out=None, *, kv_num_blocks=None, sparse_q_block=128, sparse_kv_block=128,
                config=None, check_device=True) -> bool
  compile_sm90(...same arguments as launch_fwd_sm90..., target=None) -> CompiledKernel (compile only)
  prepare_fwd_sm90_variants(...same arguments...) -> (launch, sibling launches other lengths would need)
  get_config(head_dim, dtype, **overrides) -> Sm90Config
"""
from .configs import Sm90Config, all_configs, get_config
from .fwd_sm90 import (compile_sm90, fa3_fwd_sm90_kernel, launch_fwd_sm90, prepare_fwd_sm90,
                       prepare_fwd_sm90_variants, supports_sm90)

__all__ = ["Sm90Config", "all_configs", "compile_sm90", "fa3_fwd_sm90_kernel", "get_config", "launch_fwd_sm90",
           "prepare_fwd_sm90", "prepare_fwd_sm90_variants", "supports_sm90"]
