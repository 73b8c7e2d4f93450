"""TRL and HF Trainer command lines: ``trl sft --model_name_or_path X --use_peft --lora_r 16 ...``
as an argument list (:func:`args_fields`; ``vramplan.readers.read_trl_args``) or a shell file holding the command line
(:func:`read_command_file`: ``vramplan estimate run.sh``).

The flags are parsed as transformers 5.24's ``HfArgumentParser`` parses them, from the field
table of :mod:`vramplan.readers.hf_fields` (generated from the real parsers; no transformers or
trl import): ``--x v`` and ``--x=v``; hyphens for underscores (``--per-device-train-batch-size``);
booleans alone (``--use_peft``), with a value (``--bf16 false``: ``string_to_bool``'s yes/true/t/
y/1, no/false/f/n/0) or negated (``--no_gradient_checkpointing`` where the default is True);
``nargs="+"`` lists (``--lora_target_modules q_proj v_proj``); dict fields as JSON strings
(``--model_init_kwargs '{"dtype": "bfloat16"}'``). ``--config FILE`` is TRL's YAML, which the
flags override (``TrlParser.parse_args_and_config``). An unknown flag is a warning, never an error.

Launcher flags around the script (``accelerate launch --config_file F --num_processes N``,
``torchrun --nproc_per_node N``, TRL's own ``--accelerate_config F --num_processes N``) give the
GPU count and the launch file.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..setup.inputs import load_structured, read_text
from ..specs import SpecError
from .common import Mapped, resolve_file
from .hf_fields import TRAINING_ARGUMENTS, TRL_FIELDS

__all__ = ["COMMAND_SUFFIXES", "TRL_COMMANDS", "args_fields", "parse_flags", "read_command_file", "split_command"]

#: files read as a command line (``vramplan estimate run.sh``)
COMMAND_SUFFIXES = (".sh", ".bash", ".txt", ".cmd")
#: ``trl`` subcommands (trl 1.16 ``trl/cli/main.py``)
TRL_COMMANDS = ("sft", "dpo", "grpo", "kto", "reward", "rloo")
#: TRL 1.16 subcommands read as an objective (their configs' fields: readers/trainer.py ``objective_fields``;
#: ORPO has no ``trl`` subcommand in 1.16)
TRL_OBJECTIVES = {"trl dpo": "dpo", "trl kto": "kto", "trl grpo": "grpo"}
_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")
#: launcher flags taking a value (accelerate launch 1.15, torchrun, TRL's own launch flags)
_LAUNCH_VALUE = {"config_file", "accelerate_config", "num_processes", "nproc_per_node", "nnodes", "num_machines",
                 "mixed_precision", "main_process_port", "master_port", "machine_rank", "node_rank",
                 "main_process_ip", "master_addr", "gpu_ids", "rdzv_backend", "rdzv_endpoint"}
_LAUNCH_FLAG = {"multi_gpu", "use_deepspeed", "use_fsdp", "standalone", "cpu"}


def _kinds(trl: bool) -> dict[str, str]:
    return {**TRAINING_ARGUMENTS, **TRL_FIELDS} if trl else dict(TRAINING_ARGUMENTS)


def _convert(name: str, kind: str, token: str):
    if kind in ("bool", "bool_true"):
        low = token.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise SpecError(f"--{name} takes true or false; got {token!r}")
    try:
        if kind == "int":
            return int(token)
        if kind == "float":
            return float(token)
    except ValueError:
        raise SpecError(f"--{name} must be {'an integer' if kind == 'int' else 'a number'}; got {token!r}") from None
    return token  # str, dict (JSON or a path: read by the reader), enum names


def parse_flags(argv: list[str], m: Mapped, *, trl: bool = True) -> tuple[dict, dict]:
    """(fields, launch flags) of an argument list; unknown flags and stray words are warnings."""
    kinds = _kinds(trl)
    data: dict = {}
    launch: dict = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            m.ignore(token, None, "not a flag: a word the parser would reject")
            continue
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        values: list[str] = [value] if eq else []
        if not eq:  # the words up to the next flag belong to this one
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        if name.startswith("no_") and kinds.get(name[3:]) == "bool_true" and not values:
            data[name[3:]] = False
            continue
        kind = kinds.get(name)
        if kind is None:
            if name in _LAUNCH_VALUE or name in _LAUNCH_FLAG:
                launch[name] = values[0] if values else True
            elif name == "config":
                launch["config"] = values[0] if values else None
            else:
                m.ignore(f"--{name}", " ".join(values) or None,
                         "not a TrainingArguments/TRL field vramplan reads")
            continue
        if kind == "list":
            data[name] = list(values)
            continue
        if kind in ("bool", "bool_true") and not values:
            data[name] = True
            continue
        if not values:
            raise SpecError(f"--{name} needs a value")
        if len(values) > 1:
            m.ignore(f"--{name}", " ".join(values[1:]), f"--{name} takes one value: the rest is not read")
        data[name] = _convert(name, kind, values[0])
    return data, launch


def split_command(tokens: list[str]) -> tuple[list[str], list[str], str | None]:
    """(launcher argv, script argv, the script) of a command line: the flags before and after
    ``trl SUBCOMMAND`` or the ``*.py`` script (``python -m trl.scripts.sft``'s module too);
    environment assignments (``FOO=1``) and the launcher's own name are dropped."""
    for i, tok in enumerate(tokens):
        if tok in ("trl",) and i + 1 < len(tokens) and tokens[i + 1] in TRL_COMMANDS:
            return tokens[:i], tokens[i + 2:], f"trl {tokens[i + 1]}"
        if tok.endswith(".py") or tok.startswith("trl.scripts."):
            return tokens[:i], tokens[i + 1:], tok
    return [], tokens, None


def args_fields(argv: list[str] | str, m: Mapped, *, trl: bool = True, base: Path | None = None) -> dict:
    """The fields of a TRL (or HF Trainer script) argument list, ``--config`` YAML first then the
    flags over it; launch flags go to ``m`` (GPU count, accelerate config). ``base``: the file the
    paths are relative to. Returns the field mapping the TRL/HF reader maps."""
    if isinstance(argv, str):
        argv = shlex.split(argv, comments=True)
    data, launch = parse_flags(list(argv), m, trl=trl)
    base = base or Path.cwd() / "command-line"
    if launch.get("config"):
        path = resolve_file(str(launch["config"]), base)
        loaded = load_structured(path, "TRL config")
        if not isinstance(loaded, dict):
            raise SpecError(f"{path}: a TRL config must be a mapping of fields")
        data = {**loaded, **data}
    _launch(launch, m, base)
    return data


def _launch(launch: dict, m: Mapped, base: Path) -> None:
    from .launch import read_accelerate

    for key in ("config_file", "accelerate_config"):
        name = launch.get(key)
        if not isinstance(name, str):
            continue
        path = resolve_file(name, base)
        if not path.is_file() and "/" not in name and not name.endswith((".yaml", ".yml")):
            m.ignore(f"--{key}", name, f"TRL's predefined accelerate config {name!r} (trl/accelerate_configs/"
                     f"{name}.yaml) is not read: pass --accelerate-config FILE")
            continue
        read_accelerate(load_structured(path, "accelerate config"), str(path), m)
    procs = launch.get("num_processes") or launch.get("nproc_per_node")
    if procs is not None:
        try:
            gpus = int(procs)
        except ValueError:
            raise SpecError(f"--num_processes must be an integer; got {procs!r}") from None
        nodes = launch.get("nnodes") or launch.get("num_machines")
        m.gpus = gpus * (int(nodes) if nodes and str(nodes).isdigit() else 1)
    if launch.get("mixed_precision") in ("bf16", "fp16"):
        m.amp = launch["mixed_precision"]
    for key in ("use_deepspeed", "use_fsdp"):
        if launch.get(key):
            m.ignore(f"--{key}", True, "accelerate's launch flags for DeepSpeed/FSDP are not read: pass its "
                     "--config_file (or the Trainer's --deepspeed/--fsdp)")


def read_command_file(path: Path, m: Mapped) -> tuple[str, dict]:
    """A shell or text file with one training command line (``\\`` continuations joined,
    comments dropped): (the format, ``trl`` or ``hf``, and the field mapping)."""
    text = read_text(path, "command file")
    lines = [line for line in text.replace("\\\n", " ").splitlines() if line.strip()
             and not line.lstrip().startswith("#")]
    commands = [line for line in lines if "--" in line]
    if not commands:
        raise SpecError(f"{path}: no command line with flags (trl sft --model_name_or_path ...)")
    if len(commands) > 1:
        m.ignore("command", commands[1].strip()[:80], "one command line is read: the first with flags")
    try:
        tokens = shlex.split(commands[0], comments=True)
    except ValueError as exc:
        raise SpecError(f"{path}: cannot split the command line: {exc}") from None
    launcher, script, name = split_command(tokens)
    from .peft_sft import is_peft_sft, translate

    if is_peft_sft(name, script):  # peft's examples/sft/train.py: its own model flags, SFTTrainer underneath
        script, name = translate(script, m), "trl sft"
    if name in TRL_OBJECTIVES:  # trl dpo|kto|grpo: DPOTrainer / KTOTrainer / GRPOTrainer (estimator/objectives.py)
        m.setup["objective"] = TRL_OBJECTIVES[name]
    data = args_fields(script, m, base=path)
    # a TRL script (trl sft, trl/scripts/sft.py) or TRL's own fields: TRL's defaults; else a
    # Trainer script's TrainingArguments
    trl = name is None or "trl" in name or any(k in TRL_FIELDS and k not in TRAINING_ARGUMENTS for k in data)
    flags = [i for i, t in enumerate(launcher) if t.startswith("--")]
    if flags:  # accelerate launch / torchrun flags before the script
        _, launch = parse_flags(launcher[flags[0]:], m)
        _launch(launch, m, path)
    return ("trl" if trl else "hf"), data
