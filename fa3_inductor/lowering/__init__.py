"""Recognition and lowering: everything that runs while Inductor compiles a graph."""
