"""`vramplan measure` (see the module docstring once implemented)."""
