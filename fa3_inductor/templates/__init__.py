"""Kernel templates (generic Triton, Hopper Gluon) and the mod code generator they share."""
