"""The hopper_fp8 family: FP8 (e4m3) forward attention in the Gluon Hopper kernel (templates/hopper/fwd_sm90.py,
its Quant bundle on) on the FP8 prologue's operands. Tiles: configs.py; the family: family.py."""
