"""The CLI's commands, one plain ``click.command`` per module (``measure.py`` holds measure, sweep
and calibrate); :mod:`vramplan.cli` builds the group and attaches them. What they share (setup
and GPU options, one-line errors, JSON output) is in :mod:`vramplan.commands.options`. Keep these
modules light at import time (click and vramplan's torch-free modules only).

May import: every stage (this is the top); heavy ones lazily, inside the command.
"""
