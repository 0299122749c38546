"""Runtime: the custom op Inductor's output code calls, kernel launch, tile choice."""
