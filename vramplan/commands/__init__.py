"""CLI commands that live in their own modules. Each module defines its click command(s) on
``vramplan.cli.main`` when imported; ``vramplan.cli`` imports them all at its end. Keep these
modules light at import time (click and vramplan's torch-free modules only)."""
