"""`vramplan plan` (see the module docstring once implemented)."""
