"""Read the training configs users already have: axolotl, LLaMA-Factory, TRL, torchtune, HF
``TrainingArguments`` (with the DeepSpeed JSON they name), and accelerate / DeepSpeed files alone.

:func:`read_config` detects the format (or takes ``format``), maps every memory-relevant field
to a :class:`vramplan.specs.Setup` with the framework's own defaults for what the file leaves
out (each reader cites the source it read them from), and names every field it cannot model
in a typed :class:`ReadWarning`. Torch-free: yaml and json only, through :mod:`vramplan.setup.inputs`.
One module per format; detection is :func:`detect`.

May import: util, specs, setup, estimator.
"""

from __future__ import annotations

from pathlib import Path

from ..estimator.eval_step import eval_unmodelled
from ..setup.inputs import load_structured, setup_from_mapping
from ..specs import SpecError
from .common import Mapped, ReadConfig, ReadWarning
from .planning import Change, PlanInputs, merge_fixed, plan_inputs, setup_changes

__all__ = ["FORMATS", "Change", "PlanInputs", "ReadConfig", "ReadWarning", "detect", "framework_for", "merge_fixed",
           "plan_inputs", "read_config", "read_trl_args", "setup_changes"]

#: format name -> what it is
FORMATS = {
    "axolotl": "axolotl YAML (axolotl train config.yml)",
    "llamafactory": "LLaMA-Factory YAML (llamafactory-cli train config.yaml)",
    "trl": "TRL config YAML (trl sft|dpo|grpo --config config.yaml)",
    "torchtune": "torchtune recipe YAML (tune run RECIPE --config config.yaml)",
    "hf": "HF TrainingArguments as JSON or YAML",
    "accelerate": "accelerate config YAML (accelerate launch --config_file)",
    "deepspeed": "DeepSpeed JSON (zero_optimization)",
}

_AXOLOTL = ("base_model", "micro_batch_size", "sequence_len", "lora_target_linear", "adapter")
_LLAMAFACTORY = ("finetuning_type", "cutoff_len", "lora_target", "quantization_bit", "template", "stage")
#: fields of TRL's own configs (ModelConfig, SFTConfig, GRPOConfig) that TrainingArguments lacks
_TRL_OWN = ("use_peft", "packing", "padding_free", "lora_r", "reward_funcs", "model_init_kwargs")
#: with these, also script arguments that transformers' example scripts share (their JSON is HF)
_TRL = (*_TRL_OWN, "dataset_name", "max_length", "max_seq_length")
_HF = ("model_name_or_path", "per_device_train_batch_size", "gradient_accumulation_steps", "optim", "output_dir",
       "deepspeed", "fsdp", "gradient_checkpointing", "bf16", "fp16", "num_train_epochs", "learning_rate")


def detect(data, *, json: bool = False) -> str | None:
    """The format of a parsed config, or None (a model's config.json, anything else). ``json``:
    the file is JSON, as ``HfArgumentParser.parse_json_file`` reads (``trl ... --config`` takes
    YAML): then only TRL's own fields mean TRL; ``model_name_or_path``, ``dataset_name`` and the
    sequence lengths are the script arguments transformers' example scripts share too."""
    if not isinstance(data, dict) or "model_type" in data and "architectures" in data:
        return None
    model = data.get("model")
    if isinstance(model, dict) and str(model.get("_component_", "")).startswith("torchtune."):
        return "torchtune"
    if "compute_environment" in data or "distributed_type" in data:
        return "accelerate"
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:
        return "deepspeed"
    if any(k in data for k in _AXOLOTL):
        return "axolotl"
    if any(k in data for k in _LLAMAFACTORY):
        return "llamafactory"
    if any(k in data for k in _TRL_OWN) or not json and (any(k in data for k in _TRL) or "model_name_or_path" in data):
        return "trl"
    if any(k in data for k in _HF):
        return "hf"
    return None


def _readers():
    from .axolotl import read_axolotl
    from .launch import read_accelerate, read_deepspeed
    from .llamafactory import read_llamafactory
    from .torchtune import read_torchtune
    from .trainer import read_hf, read_trl

    return {
        "axolotl": read_axolotl, "llamafactory": read_llamafactory, "trl": read_trl, "torchtune": read_torchtune,
        "hf": read_hf,
        "accelerate": lambda data, path, m: _launch_only(read_accelerate, data, path, m),
        "deepspeed": lambda data, path, m: _launch_only(read_deepspeed, data, path, m),
    }


def _launch_only(reader, data, path: Path, m: Mapped) -> None:
    """A launch file alone: its distribution on the canonical step; the rest is vramplan's defaults."""
    reader(data, str(path), m)
    if m.amp == "fp16":
        m.setup["precision"] = "fp16"
    m.assume("model", None, "a launch file names no model or training setup: pass --model and setup flags")


def read_config(path, format: str | None = None, *, accelerate=None) -> ReadConfig:
    """Read a training config; ``format`` forces one of :data:`FORMATS` instead of detecting it.
    ``accelerate``: an accelerate config YAML the run is launched with (its GPU count and, unless
    the config names its own, its DeepSpeed or FSDP setup)."""
    path = Path(path)
    m = Mapped()
    if accelerate is not None:
        from .launch import read_accelerate

        read_accelerate(load_structured(accelerate, "accelerate config"), str(accelerate), m)
    from .trl_args import COMMAND_SUFFIXES, read_command_file

    if path.suffix.lower() in COMMAND_SUFFIXES:  # a shell file with the `trl sft ...` command line
        detected, data = read_command_file(path, m)
        if format not in (None, "hf", "trl"):
            raise SpecError(f"{path}: a command line reads as TRL or HF TrainingArguments flags, not {format}")
        return _finish(data, path, format or detected, m)
    data = load_structured(path, "training config")
    detected = detect(data, json=path.suffix.lower() == ".json")
    if format is None:
        format = detected
        if format is None:
            raise SpecError(f"{path}: not a training config vramplan reads (axolotl, LLaMA-Factory, TRL, torchtune, "
                            "HF TrainingArguments, accelerate or DeepSpeed); pass --format to force one")
    elif format not in FORMATS:
        raise SpecError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
    elif detected is not None and detected != format and {detected, format} != {"hf", "trl"}:
        raise SpecError(f"{path}: reads as {detected} ({FORMATS[detected]}), not {format}; drop --format {format} "
                        f"(or pass --format {detected})")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a {format} config must be a mapping of fields")
    return _finish(data, path, format, m)


def read_trl_args(argv, *, accelerate=None, format: str = "trl") -> ReadConfig:
    """Read a TRL (``format="trl"``) or HF Trainer script's (``"hf"``) command-line flags, an
    argument list or one string, parsed as ``HfArgumentParser`` parses them
    (:mod:`vramplan.readers.trl_args`): ``read_trl_args("--model_name_or_path X --use_peft")``."""
    from .trl_args import args_fields

    if format not in ("trl", "hf"):
        raise SpecError(f"command-line flags read as trl or hf; got {format!r}")
    m = Mapped()
    if accelerate is not None:
        from .launch import read_accelerate

        read_accelerate(load_structured(accelerate, "accelerate config"), str(accelerate), m)
    data = args_fields(argv, m, trl=format == "trl")
    return _finish(data, Path.cwd() / "command-line", format, m)


def framework_for(format: str, fields) -> str:
    """The framework a config of ``format`` with these Setup ``fields`` is estimated as
    (setup/frameworks.py): TRL, axolotl and LLaMA-Factory where their preparation is modelled (SFT on
    one GPU or DDP ranks, no GPTQ/AWQ base, modules_to_save or DoRA), else the HF Trainer recipe (their
    ZeRO/FSDP runs prepare as it does there: DeepSpeed's engine casts, FSDP skips the k-bit preparation)."""
    if format == "torchtune":  # its single-device recipes' own step (estimator/torchtune.py; the builder: its reader)
        return "torchtune" if _torchtune_modelled(fields) else "hf"
    if format not in ("trl", "axolotl", "llamafactory"):
        return "hf"
    s = fields
    sharded = s.get("zero_stage") or s.get("fsdp", "none") != "none" or s.get("tp", 1) > 1 or s.get("cp", 1) > 1 \
        or s.get("device_map", "none") != "none"
    if sharded or s.get("objective", "sft") != "sft" or s.get("quant") in ("gptq", "awq") \
            or s.get("modules_to_save") or s.get("dora"):
        return "hf"
    return format


def _torchtune_modelled(fields) -> bool:
    from ..setup.checks import check_torchtune
    from ..specs import Setup

    s = {k: v for k, v in dict(fields).items() if k in Setup.__dataclass_fields__}
    if s.get("fsdp", "none") != "none" or s.get("zero_stage") or s.get("objective", "sft") != "sft":
        return False
    try:
        check_torchtune(Setup(**{**s, "framework": "torchtune"}))
    except SpecError:
        return False
    return True


def _framework(format: str, m: Mapped) -> None:
    if format not in ("trl", "axolotl", "llamafactory"):
        return
    if framework_for(format, m.setup) == format:
        m.setup["framework"] = format
    else:
        m.assume("framework", format, "its preparation is modelled for SFT on one GPU or DDP ranks without "
                 "modules_to_save or DoRA: the HF Trainer recipe (--framework hf) is estimated")
    if m.setup.get("activation_offload") and m.setup.get("loss") == "trl" and m.setup.get("framework") != "trl":
        m.setup["activation_offload"] = False
        m.ignore("activation_offloading", True, "activation offloading with TRL's fused LM head (loss trl) is "
                 "modelled with TRL preparing the model (--framework trl), not on the HF recipe read here: "
                 "activations stay on the GPU")


def _finish(data: dict, path: Path, format: str, m: Mapped) -> ReadConfig:
    _readers()[format](data, path, m)
    _framework(format, m)
    if m.gpus is not None:
        m.setup["gpus"] = m.gpus
    elif m.setup.get("zero_stage") or m.setup.get("fsdp", "none") != "none":
        m.assume("gpus", None, "the config does not fix the GPU count: 1 assumed (pass --gpus N)")
    setup = setup_from_mapping(dict(m.setup), str(path))
    why = eval_unmodelled(setup)
    if why:  # an eval the estimate cannot model yet: a warning, the training step's peak only
        m.ignore("eval_batch", m.setup.pop("eval_batch"), f"an eval step with {why} is not modelled yet: the "
                 "training step's peak only")
        setup = setup.replace(eval_batch=0)
    return ReadConfig(path=str(path), format=format, model=m.model, setup=setup, gpus=m.gpus,
                      warnings=tuple(m.warnings), fields=dict(m.setup))
