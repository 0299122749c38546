"""Runtime: the custom ops Inductor's output code calls (ops.py: the forward; ops_bwd.py: the backward
families; backward_cpu.py: the dense backward recompute), kernel launch, tile choice."""
