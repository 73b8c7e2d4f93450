"""The ``vramplan`` command line: a click group of the commands in :mod:`vramplan.commands`.

Import cost matters (``vramplan estimate`` should answer in well under 0.3 s): this module and
the command modules import only click and vramplan's torch-free modules at the top; rich is
imported by the printing functions and torch only inside ``vramplan trace`` (and the workers of
``measure``/``validate``). ``tests/test_imports.py`` holds that line. The options the commands
share, and the one-line errors and warnings, are in :mod:`vramplan.commands.options`.
"""

from __future__ import annotations

import sys

import click

from .commands.check import check
from .commands.emit import emit
from .commands.estimate import estimate
from .commands.gpus import gpus
from .commands.measure import calibrate, measure, sweep
from .commands.models import models
from .commands.plan import plan
from .commands.trace import trace
from .commands.validate import validate

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vramplan", prog_name="vramplan")
def main() -> None:
    """Will it fit? GPU memory of one LLM fine-tuning step, before you rent the GPU.

    MODEL is a shipped name or alias (`vramplan models`), a Hugging Face id, a config.json, or a
    directory holding one.
    """


for _command in (estimate, trace, models, gpus, check, emit, measure, sweep, calibrate, plan, validate):
    main.add_command(_command)
del _command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
