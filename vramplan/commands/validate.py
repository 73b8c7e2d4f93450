"""`vramplan validate` (see the module docstring once implemented)."""
