"""A plan in the user's own framework: axolotl, LLaMA-Factory, TRL, torchtune and Unsloth configs.

Each writer is the inverse of its reader (:mod:`vramplan.readers`): a pure function of the Setup
that returns the framework's config mapping, with every memory-relevant Setup field in that
framework's words (``TrainingArguments.optim`` strings for the HF-based three, ``_component_``
paths for torchtune). A Setup value the framework cannot express is refused with one line
(:class:`~vramplan.specs.SpecError`: ``torchtune cannot express fsdp shard_grad_op: ...``), never
written as something else: :func:`refusal` names the first such value.

Files: the config (``axolotl.yaml``, ``llamafactory.yaml``, ``trl.yaml``, ``torchtune.yaml``), the
DeepSpeed JSON it names by relative path (``deepspeed: ds_config.json``) for ZeRO plans, and the
accelerate YAML its launch line passes for plans on several GPUs (the GPU count; FSDP for
LLaMA-Factory and TRL, which take FSDP from accelerate). Values go through ``yaml.safe_dump`` /
``json.dumps`` only; the header comments go through :func:`vramplan.emit.common.comment`.
"""

from __future__ import annotations

import json

import yaml

from ..setup.frameworks import framework
from ..specs import ModelSpec, Plan, Setup, SpecError
from .common import ACCELERATE_CONFIG, DS_CONFIG, PLAN_FILE, comment, estimate_line, uses_deepspeed

__all__ = ["CONFIG_FILES", "FRAMEWORKS", "LIMITS", "companion_files", "framework_config", "framework_files",
           "framework_limits", "framework_run", "refusal", "writer_for"]

#: format -> the config file it writes
CONFIG_FILES = {"axolotl": "axolotl.yaml", "llamafactory": "llamafactory.yaml", "trl": "trl.yaml",
                "torchtune": "torchtune.yaml", "unsloth": "unsloth.yaml"}
FRAMEWORKS = tuple(CONFIG_FILES)

#: format -> the framework's name in messages
NAMES = {"axolotl": "axolotl", "llamafactory": "LLaMA-Factory", "trl": "TRL", "torchtune": "torchtune",
         "unsloth": "Unsloth"}

#: what each config leaves to the user (not part of a memory plan)
_TODO = {
    "axolotl": "add your datasets (datasets:), output_dir and the usual training fields (learning_rate, ...)",
    "llamafactory": "add dataset, template and output_dir",
    "trl": "add dataset_name (or pass --dataset_name) and output_dir",
    "unsloth": "set dataset_name (a dataset with a text column); unsloth_train.py reads this file",
}


#: Setup knobs a plan from a config of this format keeps at the value the framework can run (the
#: search would otherwise pick savers the framework has no field for: torchtune builds its own
#: modules, so no Liger and no attention choice, and shards with FSDP, not ZeRO)
LIMITS = {"torchtune": {"liger": False, "attn": "auto", "zero_stage": 0}}
#: where a knob the framework's config has no field for is held (hf_configs.common_refusal)
_UNWRITTEN_AT = {"checkpoint_every": 1, "optimizer_in_backward": False}
# each framework's unwritten knobs (setup/frameworks.py Framework.unwritten: its plans do not search them
# either); TrainingArguments files ("hf") have neither field
LIMITS = {fmt: {**LIMITS.get(fmt, {}), **{k: _UNWRITTEN_AT[k] for k in
                                          (tuple(_UNWRITTEN_AT) if fmt == "hf" else framework(fmt).unwritten)}}
          for fmt in (*FRAMEWORKS, "hf")}


def framework_limits(fmt: str) -> dict:
    """The knobs ``plan --from FILE`` fixes for a FILE of ``fmt`` (:data:`LIMITS`; a copy)."""
    return dict(LIMITS.get(fmt, {}))


def writer_for(fmt: str):
    """The config function of ``fmt`` (Setup, ModelSpec, model_id=, nodes=) -> dict."""
    from . import hf_configs, torchtune, unsloth

    return {"axolotl": hf_configs.axolotl_config, "llamafactory": hf_configs.llamafactory_config,
            "trl": hf_configs.trl_config, "torchtune": torchtune.torchtune_config,
            "unsloth": unsloth.unsloth_config}[fmt]


def _hub_id(model: ModelSpec) -> str | None:
    return model.name if model.source.startswith(("profile:", "hub:")) else None


def refusal(fmt: str, setup: Setup, model: ModelSpec) -> str | None:
    """Why ``fmt`` cannot express ``setup`` (one clause, ``"fsdp shard_grad_op: ..."``), or None."""
    from . import hf_configs, torchtune, unsloth

    if fmt == "torchtune":
        return torchtune.refusal(setup, model)
    if fmt == "unsloth":
        return unsloth.refusal(setup, model)
    return hf_configs.refusal(fmt, setup, model)


def framework_config(plan: Plan, fmt: str, model: ModelSpec) -> dict:
    """The config mapping of ``fmt`` for ``plan`` (a new dict); a SpecError when ``fmt`` cannot
    express the plan's setup."""
    why = refusal(fmt, plan.setup, model)
    if why:
        raise SpecError(f"cannot emit {fmt}: {NAMES[fmt]} cannot express {why}")
    return writer_for(fmt)(plan.setup, model, model_id=_hub_id(model) or plan.model, nodes=plan.nodes)


def framework_run(plan: Plan, fmt: str) -> str:
    """The command that runs the emitted config, from the emitted directory."""
    cfg, s = CONFIG_FILES[fmt], plan.setup
    acc = f"--config_file {ACCELERATE_CONFIG}"
    if fmt == "axolotl":
        return f"accelerate launch {acc} -m axolotl.cli.train {cfg}" if s.gpus > 1 else f"axolotl train {cfg}"
    if fmt == "llamafactory":
        if s.gpus == 1:
            return f"llamafactory-cli train {cfg}"
        # LLaMA-Factory's accelerate examples (examples/accelerate/): from a LLaMA-Factory checkout
        return f"accelerate launch {acc} src/train.py {cfg}"
    if fmt == "trl":
        return f"trl sft --config {cfg}" + (f" --accelerate_config {ACCELERATE_CONFIG}" if s.gpus > 1 else "")
    if fmt == "unsloth":
        from .unsloth import TRAIN_FILE

        return f"python {TRAIN_FILE} {cfg}"
    from .torchtune import recipe

    nproc = f"--nproc_per_node {s.gpus} " if s.fsdp != "none" else ""
    return f"tune run {nproc}{recipe(s)} --config {cfg}"


def _header(plan: Plan, fmt: str) -> list[str]:
    from .. import __version__

    topology = f"{plan.setup.gpus} GPU{'s' if plan.setup.gpus > 1 else ''}"
    if plan.nodes > 1:
        topology += f" on {plan.nodes} nodes"
    return [f"vramplan {__version__}: {NAMES[fmt]} config of the plan for {plan.model} on {topology}",
            f"setup: {_describe(plan.setup)}",
            f"estimate: {estimate_line(plan)}",
            f"run: {framework_run(plan, fmt)}",
            f"memory-relevant fields only: {_todo(plan, fmt)}",
            f"the plan and the estimate it was made from: {PLAN_FILE}"]


def _todo(plan: Plan, fmt: str) -> str:
    if fmt == "torchtune":
        return (f"download the checkpoint (tune download {plan.model} --output-dir /tmp/"
                f"{plan.model.rsplit('/', 1)[-1]}), check checkpoint_files, set the dataset")
    return _TODO[fmt]


def _describe(setup: Setup) -> str:
    from ..setup.wording import describe

    return describe(setup)


def companion_files(plan: Plan, fmt: str, model: ModelSpec) -> dict[str, str]:
    """The DeepSpeed JSON (ZeRO) and accelerate YAML (several GPUs) the config and its launch line
    name, with this framework's header."""
    from .accelerate import accelerate_config
    from .deepspeed import setup_config

    files = {}
    lines = _header(plan, fmt)
    if uses_deepspeed(plan):
        files[DS_CONFIG] = json.dumps({"_comment": lines, **setup_config(model, plan.setup)}, indent=2,
                                      ensure_ascii=False) + "\n"
    if plan.setup.gpus > 1:
        files[ACCELERATE_CONFIG] = comment(lines) + yaml.safe_dump(accelerate_config(plan), sort_keys=False, width=100)
    return files


def dumps_config(plan: Plan, fmt: str, config: dict) -> str:
    return comment(_header(plan, fmt)) + yaml.safe_dump(config, sort_keys=False, width=100, allow_unicode=True)


def framework_files(plan: Plan, fmt: str, model: ModelSpec) -> dict[str, str]:
    """File name -> text for ``fmt``: the config and its companion files."""
    config = framework_config(plan, fmt, model)
    files = {CONFIG_FILES[fmt]: dumps_config(plan, fmt, config), **companion_files(plan, fmt, model)}
    if fmt == "unsloth":  # the fixed script that reads the config (no plan value in it)
        from .unsloth import SCRIPT, TRAIN_FILE

        files[TRAIN_FILE] = SCRIPT
    return files
