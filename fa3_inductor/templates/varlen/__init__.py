"""The varlen template: attention over packed variable-length sequences (no padding).

kernel.py (the Triton forward, notation and work list), host.py (prepare / launch / compile-only),
configs.py (tile table), dense.py (the torch path for CPU without the interpreter, and gradients).
The front door is ``fa3_inductor.varlen.flex_varlen``.
"""
