"""`vramplan check` (see the module docstring once implemented)."""
