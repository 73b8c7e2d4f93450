"""The ``vramplan`` command line: a click group of the commands in :mod:`vramplan.commands`.

Import cost matters (``vramplan estimate`` should answer in well under 0.3 s): this module and
the command modules (each imported when its command runs) import only click and vramplan's torch-free
modules at the top; rich is imported by the printing functions and torch only inside ``vramplan trace``
(and the workers of ``measure``/``validate``). ``tests/test_imports.py`` holds that line. The options the commands
share, and the one-line errors and warnings, are in :mod:`vramplan.commands.options`.
"""

from __future__ import annotations

import os
import signal
import sys

import click

__all__ = ["main"]

#: command -> its module in vramplan.commands: each is imported when it runs (or ``--help`` lists them), so
#: ``vramplan models`` or ``gpus`` never loads the estimator and the search
_COMMANDS = {"estimate": "estimate", "trace": "trace", "models": "models", "gpus": "gpus", "check": "check",
             "emit": "emit", "measure": "measure", "sweep": "measure", "calibrate": "measure", "plan": "plan",
             "validate": "validate", "doctor": "doctor"}

# Ctrl-C while the command modules import: vramplan/__init__.py installs a handler that prints one
# line and exits 130 when run as the command; main() hands Ctrl-C back to KeyboardInterrupt.
_AS_COMMAND = os.path.basename(sys.argv[0] if sys.argv else "") in ("vramplan", "__main__.py", "-m")


def _stdout_is_devnull() -> bool:
    try:
        out, null = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
    return (out.st_dev, out.st_ino) == (null.st_dev, null.st_ino)


class _Vramplan(click.Group):
    """The group whose every outcome is one of the documented exits: 0 (done; also when stdout is
    closed early, as by ``| head``), 1 (a regression, from ``check``), 2 (bad input or usage, one
    ``error:`` line), 130 (interrupted, one line). Its commands load lazily (``_COMMANDS``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*_COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            import importlib

            module = importlib.import_module(f".commands.{_COMMANDS[cmd_name]}", __package__)
            self.add_command(getattr(module, cmd_name))
        return self.commands.get(cmd_name)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        from .commands.options import silence_stdout, usage_line

        handler = signal.getsignal(signal.SIGINT)
        if _AS_COMMAND and getattr(handler, "__name__", "") == "_interrupted_at_startup":
            signal.signal(signal.SIGINT, signal.default_int_handler)  # unwind normally from here on
        was_devnull = _stdout_is_devnull()
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except SystemExit as exc:
            # rich answers a closed pipe with SystemExit(1) after pointing stdout at /dev/null;
            # exit 1 means "regression" to check's callers, so a closed pipe is 0 here
            if exc.code == 1 and not was_devnull and _stdout_is_devnull():
                code = 0
            else:
                raise
        except click.exceptions.Abort:  # click's form of KeyboardInterrupt / EOF at a prompt
            click.echo("error: interrupted", err=True)
            code = 130
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            code = 130
        except click.ClickException as exc:
            click.echo(usage_line(exc), err=True)
            code = 2
        except BrokenPipeError:  # stdout closed by the reader: not an error
            silence_stdout()
            code = 0
        except OSError as exc:
            if exc.errno != 32:  # EPIPE
                raise
            silence_stdout()
            code = 0
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Vramplan, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vramplan", prog_name="vramplan")
def main() -> None:
    """Will it fit? GPU memory of one LLM fine-tuning step, before you rent the GPU.

    MODEL is a shipped name or alias (`vramplan models`), a Hugging Face id, a config.json, or a
    directory holding one.
    """


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
