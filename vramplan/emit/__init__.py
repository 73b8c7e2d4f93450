"""Emitters: the files a user launches a plan with, as pure functions of the Plan.

- :func:`deepspeed_config` (``ds_config.json``), :func:`accelerate_config`
  (``accelerate_config.yaml``), :func:`train_script` (``train.py``), :func:`launch_command`;
- :func:`render` maps file names to their text for a set of formats (no I/O);
- :func:`emit_to_dir` is the only function that writes: atomically, file by file, and never into
  an existing non-empty directory unless ``force``.

Formats: ``deepspeed``, ``accelerate``, ``trainer``, and the frameworks' own configs ``axolotl``,
``llamafactory``, ``trl``, ``torchtune`` (:mod:`vramplan.emit.frameworks`). ``trainer`` writes train.py, launch.sh,
vramplan.json (the plan and the estimate it was made from), the model's config.json, and the config
files its launch command reads (ds_config.json for ZeRO plans, accelerate_config.yaml, the
hostfile of a multi-node DeepSpeed plan), so that the emitted directory runs as its header says.
Without an explicit list, ``deepspeed`` is emitted only for plans that use ZeRO, and no framework
config is written.

May import: util, specs, model, setup, estimator, plans, readers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..specs import ModelSpec, Plan, SpecError
from .accelerate import accelerate_config
from .common import (
    ACCELERATE_CONFIG,
    DS_CONFIG,
    HOSTFILE,
    LAUNCH_SCRIPT,
    MODEL_CONFIG,
    PLAN_FILE,
    TRAIN_SCRIPT,
    launch_command,
    launch_commands,
    plan_model,
    uses_deepspeed,
)
from .deepspeed import deepspeed_config
from .frameworks import FRAMEWORKS, framework_files, framework_run
from .trainer import hostfile, launch_script, objective_script, train_script

#: the DPO/GRPO trainer train.py imports for a plan with an objective (emit/templates/trl_objective.py.tmpl)
OBJECTIVE_SCRIPT = "trl_objective.py"

FORMATS = ("deepspeed", "accelerate", "trainer", *FRAMEWORKS)

__all__ = ["FORMATS", "accelerate_config", "check_out_dir", "deepspeed_config", "default_formats", "emit_to_dir",
           "framework_run", "launch_command", "launch_commands", "parse_formats", "render", "run_command",
           "train_script", "write_back_to_dir"]


def default_formats(plan: Plan) -> tuple[str, ...]:
    """Every format the plan uses: DeepSpeed only with ZeRO; a plan for another framework than the HF
    Trainer recipe (``--framework trl``, ...) is written as that framework's config."""
    if plan.setup.framework in FRAMEWORKS:
        return (plan.setup.framework,)
    return ("deepspeed", "accelerate", "trainer") if uses_deepspeed(plan) else ("accelerate", "trainer")


def parse_formats(text: str) -> tuple[str, ...]:
    """``"deepspeed,trainer"`` -> ("deepspeed", "trainer"); unknown names are a SpecError."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise SpecError(f"unknown format {unknown[0] if unknown else text!r}; use a comma-separated list of "
                        f"{', '.join(FORMATS)}")
    return names


def render(plan: Plan, formats: tuple[str, ...] | list[str] | None = None, *,
           model: ModelSpec | None = None) -> dict[str, str]:
    """File name -> text for ``formats`` (default: :func:`default_formats`). Pure: no I/O beyond
    reading the shipped template and the model's config, and the plan is not touched.

    ``model`` is the plan's ModelSpec when the caller has it (``Plan.model`` is only its name;
    without it, the name is resolved again)."""
    from ..plans.planfile import dumps_plan
    from . import accelerate as acc
    from . import deepspeed as ds

    formats = default_formats(plan) if formats is None else tuple(formats)
    for name in formats:
        if name not in FORMATS:
            raise SpecError(f"unknown format {name!r}; use {', '.join(FORMATS)}")
    model = model or plan_model(plan)
    from ..setup.compat import known_failures

    hits = known_failures(plan.setup, model)
    if hits:  # never write a combination known not to run (vramplan/setup/compat.py)
        raise SpecError(f"refusing to emit: {hits[0].message()}")
    if plan.setup.pp > 1:  # estimated (estimator/pipeline.py), not emitted: no writer runs a schedule yet
        raise SpecError(f"cannot emit a pipeline-parallel plan yet (--pp {plan.setup.pp}): no emitted config runs "
                        "torch.distributed.pipelining's schedules; the estimate is what vramplan gives for it")
    if plan.setup.ep > 1:  # estimated (estimator/expert_parallel.py), not emitted: train.py loads no ep_size yet
        raise SpecError(f"cannot emit an expert-parallel plan yet (--ep {plan.setup.ep}): the emitted train.py does "
                        "not load with DistributedConfig(ep_size); the estimate is what vramplan gives for it")
    if "trainer" in formats and plan.setup.framework != "hf":
        from ..setup.frameworks import framework

        fw = framework(plan.setup.framework)
        raise SpecError(f"cannot emit trainer: train.py runs the HF Trainer with peft's QLoRA recipe (--framework hf), "
                        f"and this plan's memory is {fw.title}'s (--framework {fw.name}): use --format {fw.name}")
    files: dict[str, str] = {}
    if "deepspeed" in formats or ("trainer" in formats and uses_deepspeed(plan)):
        files[DS_CONFIG] = ds.dumps(deepspeed_config(plan, model=model))
    if "accelerate" in formats or "trainer" in formats:
        files[ACCELERATE_CONFIG] = acc.dumps(plan, accelerate_config(plan))
    if "trainer" in formats:
        files[TRAIN_SCRIPT] = train_script(plan, model=model)
        if plan.setup.objective != "sft":  # DPO/GRPO: TRL's trainer beside train.py
            files[OBJECTIVE_SCRIPT] = objective_script()
        files[LAUNCH_SCRIPT] = launch_script(plan)
        if plan.nodes > 1 and uses_deepspeed(plan):
            files[HOSTFILE] = hostfile(plan)
        files[MODEL_CONFIG] = json.dumps(model.config, indent=2) + "\n"
    for name in formats:
        if name in FRAMEWORKS:  # their companion files yield to the deepspeed/accelerate/trainer formats'
            for file_name, text in framework_files(plan, name, model).items():
                files.setdefault(file_name, text)
    files[PLAN_FILE] = dumps_plan(plan)
    return files


def run_command(plan: Plan, formats: tuple[str, ...] | list[str] | None = None) -> str:
    """The command that runs what ``formats`` wrote: train.py's launch command, or the first
    framework config's when no train.py is written."""
    formats = default_formats(plan) if formats is None else tuple(formats)
    if "trainer" not in formats:
        for name in formats:
            if name in FRAMEWORKS:
                return framework_run(plan, name)
    return launch_command(plan)


def check_out_dir(out_dir: str | os.PathLike, force: bool) -> None:
    """The checks :func:`emit_to_dir` makes before it writes (``plan --emit`` makes them before it
    writes anything else): ``out_dir`` is a directory or absent, and empty unless ``force``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SpecError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise SpecError(f"{out} exists and is not empty; pass --force to overwrite its files")


def emit_to_dir(plan: Plan, out_dir: str | os.PathLike, formats: tuple[str, ...] | list[str] | None = None,
                force: bool = False, *, model: ModelSpec | None = None) -> list[Path]:
    """Write the files of ``formats`` into ``out_dir`` (``model``: as for :func:`render`); return
    their paths.

    An existing non-empty ``out_dir`` is refused (one-line SpecError) unless ``force``; with
    ``force`` its files of the same names are replaced and other files there are left alone.
    The files are staged and moved into place together: an interrupted emit leaves all or none.
    """
    from ..util.fileio import write_files

    check_out_dir(out_dir, force)
    files = render(plan, formats, model=model)
    data = {name: text.encode("utf-8") for name, text in files.items()}
    return write_files(out_dir, data, executable=frozenset({LAUNCH_SCRIPT, TRAIN_SCRIPT}))


def write_back_to_dir(read, source_setup, plan: Plan, out_dir: str | os.PathLike, force: bool = False, *,
                      model: ModelSpec, as_written) -> list[Path]:
    """``plan --from FILE --emit DIR``: FILE (``read``, a :class:`vramplan.readers.ReadConfig`)
    written into ``out_dir`` with only the plan's changes to ``source_setup`` changed
    (:func:`vramplan.emit.writeback.write_back`); written as :func:`emit_to_dir` writes. FILE itself
    is never touched."""
    from ..util.fileio import write_files
    from .writeback import write_back

    check_out_dir(out_dir, force)
    files = write_back(read, source_setup, plan, model, as_written)
    if Path(out_dir).resolve() == Path(read.path).resolve().parent and Path(read.path).name in files:
        raise SpecError(f"--emit {out_dir} would overwrite {read.path}; write it into another directory")
    return write_files(out_dir, {name: text.encode("utf-8") for name, text in files.items()})
