"""`vramplan emit`: the files that launch a plan (DeepSpeed JSON, Accelerate YAML, train.py), or the
plan in a framework's own config (axolotl, LLaMA-Factory, TRL, torchtune).

The emitters are pure functions in :mod:`vramplan.emit`; this module reads the plan file, writes
the directory through :func:`vramplan.emit.emit_to_dir` and prints what it wrote. No torch.
"""

from __future__ import annotations

import shlex

import click

from .options import user_errors


@click.command()
@click.argument("plan_file", metavar="PLAN")
@click.option("--format", "formats", default=None, metavar="LIST",
              help="Comma-separated: deepspeed, accelerate, trainer, axolotl, llamafactory, trl, torchtune  "
                   "[default: deepspeed (only with ZeRO), accelerate, trainer]")
@click.option("--out", "out_dir", required=True, metavar="DIR", help="Directory to write (created; must be empty).")
@click.option("--force", is_flag=True, help="Overwrite the files in an existing, non-empty DIR.")
@user_errors
def emit(plan_file: str, formats: str | None, out_dir: str, force: bool) -> None:
    """Write ready-to-run files for the plan in PLAN (a plan file from `vramplan plan`).

    `--format trainer` writes train.py, launch.sh, the model's config.json (random weights, no
    download), vramplan.json (the plan and its estimate) and the configs its launch command reads.
    `--format axolotl|llamafactory|trl|torchtune|unsloth` writes the plan as that framework's config (with
    the DeepSpeed JSON / accelerate YAML it names); a setup it cannot express is refused.
    """
    from ..emit import emit_to_dir, parse_formats, run_command
    from ..plans.planfile import load_plan

    plan = load_plan(plan_file)
    chosen = parse_formats(formats) if formats is not None else None
    paths = emit_to_dir(plan, out_dir, chosen, force=force)
    for path in paths:
        click.echo(str(path))
    click.echo(f"run: cd {shlex.quote(out_dir)} && {run_command(plan, chosen)}", err=True)
