"""The generic kernel family: a plain Triton forward for every CUDA GPU and the CPU interpreter.

kernel.py (the kernel), host.py (launch preparation), configs.py (tile table with the reasons),
family.py (the kernel-family interface). Mods in the ``tl`` dialect (templates/modgen.py).
"""
