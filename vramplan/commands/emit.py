"""`vramplan emit` (see the module docstring once implemented)."""
