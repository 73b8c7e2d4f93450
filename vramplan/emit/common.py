"""What every emitter shares: which engine launches a plan, the launch commands, and the header
that opens each emitted file (the command that runs it and the estimate it was made for).

Everything here is a pure function of the Plan; the headers carry no date and no version, so the
same plan always emits the same bytes (golden files in tests/golden/emit/).
"""

from __future__ import annotations

import re

from ..setup.wording import describe
from ..specs import ModelSpec, Plan, SpecError
from ..util.units import fmt_bytes

#: File names inside an emitted directory.
DS_CONFIG = "ds_config.json"
ACCELERATE_CONFIG = "accelerate_config.yaml"
TRAIN_SCRIPT = "train.py"
LAUNCH_SCRIPT = "launch.sh"
HOSTFILE = "hostfile"
PLAN_FILE = "vramplan.json"
MODEL_CONFIG = "config.json"

MAIN_PORT = 29500

#: Setup.fsdp -> accelerate's FSDP sharding strategy (FSDP1, what the truth in vramplan/truths/fsdp.py
#: runs); with ``dp_replicate`` > 1 the hybrid ones (:func:`fsdp1_strategy`).
FSDP_STRATEGIES = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
}
#: Setup.fsdp under hybrid sharding (``dp_replicate`` > 1) -> accelerate 1.15's FSDP1 strategy name
#: (utils/constants.py FSDP_SHARDING_STRATEGY: torch's HYBRID_SHARD and _HYBRID_SHARD_ZERO2).
HYBRID_STRATEGIES = {"full_shard": "HYBRID_SHARD", "shard_grad_op": "HYBRID_SHARD_ZERO2"}


def fsdp1_strategy(setup) -> str:
    """accelerate's ``fsdp_sharding_strategy`` of an FSDP1 setup (hybrid with ``dp_replicate`` > 1)."""
    if getattr(setup, "dp_replicate", 1) > 1:
        return HYBRID_STRATEGIES[setup.fsdp]
    return FSDP_STRATEGIES[setup.fsdp]


def default_lr(setup) -> float:
    """The learning rate train.py starts from: the usual 2e-4 for adapters, 2e-5 for full tuning."""
    return 2e-4 if setup.adapters else 2e-5


def plan_model(plan: Plan) -> ModelSpec:
    """The ModelSpec the plan was made for (``load_model`` is cached, so this is a lookup)."""
    from ..model.profiles import load_model

    return load_model(plan.model)


def fsdp_mode(plan: Plan) -> str:
    """The plan's FSDP sharding ('none' when the Setup has no ``fsdp`` field or does not shard)."""
    mode = getattr(plan.setup, "fsdp", "none") or "none"
    if mode != "none" and mode not in FSDP_STRATEGIES:
        raise SpecError(f"fsdp must be none or one of {', '.join(FSDP_STRATEGIES)}; got {mode!r}")
    if mode != "none" and plan.setup.zero_stage:
        raise SpecError("a plan uses DeepSpeed ZeRO or FSDP, not both")
    return mode


def uses_deepspeed(plan: Plan) -> bool:
    return plan.setup.zero_stage > 0


def launcher(plan: Plan) -> str:
    """The engine that launches the plan: ``deepspeed`` (ZeRO), ``accelerate`` (FSDP or several
    GPUs without ZeRO) or ``python`` (one GPU, nothing sharded)."""
    if uses_deepspeed(plan):
        return "deepspeed"
    if plan.setup.device_map != "none":  # a layer split is one process driving every GPU: not torchrun
        return "python"
    if fsdp_mode(plan) != "none" or plan.setup.gpus > 1:
        return "accelerate"
    return "python"


def launch_commands(plan: Plan) -> tuple[str, ...]:
    """Shell commands that run the emitted train.py, the preferred one first; each runs from the
    emitted directory. Multi-node commands read ``$MAIN_IP`` (node 0's address) and, where every
    node runs its own command, ``$NODE_RANK``."""
    s = plan.setup
    ds = f" --deepspeed {DS_CONFIG}" if uses_deepspeed(plan) else ""
    acc = f"accelerate launch --config_file {ACCELERATE_CONFIG}"
    script = TRAIN_SCRIPT + ds
    if plan.nodes > 1:
        per_node = f'{acc} --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" {script}'
        if uses_deepspeed(plan):
            deepspeed = (f"deepspeed --hostfile {HOSTFILE} --num_nodes {plan.nodes} --num_gpus {plan.gpus_per_node} "
                         f'--master_addr "$MAIN_IP" --master_port {MAIN_PORT} {script}')
            return (deepspeed, per_node)
        torchrun = (f'torchrun --nnodes {plan.nodes} --nproc_per_node {plan.gpus_per_node} --node_rank "$NODE_RANK" '
                    f'--master_addr "$MAIN_IP" --master_port {MAIN_PORT} {script}')
        return (per_node, torchrun)
    if uses_deepspeed(plan):
        return (f"deepspeed --num_gpus {s.gpus} {script}", f"{acc} {script}")
    if launcher(plan) == "accelerate":
        if fsdp_mode(plan) != "none":
            return (f"{acc} {script}",)
        return (f"{acc} {script}", f"torchrun --nproc_per_node {s.gpus} {script}")
    if s.device_map != "none":  # one process: accelerate launch would start one per GPU
        return (f"python {script}",)
    return (f"python {script}", f"{acc} {script}")


def launch_command(plan: Plan) -> str:
    """The preferred command that runs the plan (what ``launch.sh`` runs)."""
    return launch_commands(plan)[0]


def estimate_line(plan: Plan) -> str:
    """One line: the estimate the files were made for (per GPU), the fit verdict and the speed."""
    bd = plan.breakdown
    line = (f"{fmt_bytes(bd.device_total_bytes)} per GPU (device total; "
            f"peak allocated {fmt_bytes(bd.peak_allocated_bytes)}, tensor peak {fmt_bytes(bd.tensor_peak_bytes)})")
    if bd.host_bytes:
        line += f", {fmt_bytes(bd.host_bytes)} host RAM"
    if plan.gpu is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        line += f" on {plan.gpu.display_name} ({fmt_bytes(plan.gpu.usable_memory_bytes)} usable): {verdict}"
    if plan.tokens_per_s:
        line += f"; ~{plan.tokens_per_s:,.0f} tokens/s"
    return line


def header_lines(plan: Plan, runs: str | None = None) -> list[str]:
    """The opening comment of every emitted file (without comment markers): what the plan is, the
    command that runs it, the estimate it was made for. ``runs`` names how this file is used when
    that is not simply the launch command."""
    topology = f"{plan.setup.gpus} GPU{'s' if plan.setup.gpus > 1 else ''}"
    if plan.nodes > 1:
        topology += f" on {plan.nodes} nodes ({plan.gpus_per_node} per node)"
    lines = [
        f"vramplan plan for {plan.model} on {topology}",
        describe(plan.setup),
        f"estimate: {estimate_line(plan)}",
        f"run (from this directory): {launch_command(plan)}",
    ]
    for alt in launch_commands(plan)[1:]:
        lines.append(f"       or: {alt}")
    if plan.nodes > 1:
        lines.append(f"multi-node: set MAIN_IP to node 0's address, NODE_RANK to each node's rank (0..{plan.nodes - 1})"
                     + (f" for the per-node command; list the nodes in {HOSTFILE}" if uses_deepspeed(plan) else ""))
    if runs:
        lines.append(runs)
    lines.append(f"the plan and the estimate it was made from: {PLAN_FILE}")
    return lines


#: Characters a comment may hold as they are in every language it lands in (shell, Python, YAML):
#: printable text and tabs; no line or paragraph separators, controls or BOM.
_UNSAFE = re.compile("[^\t\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]")


def one_line(text: str) -> str:
    """``text`` as one comment-safe line: a newline, carriage return, form feed, NUL, Unicode line
    separator (anything shell, Python or YAML could end a line on, or refuse) becomes its visible
    escape (``\\n``, ``\\x0c``, ``\\u2028``), so a value from a user never leaves its comment."""
    return _UNSAFE.sub(_escaped, text)


def _escaped(match: re.Match) -> str:
    ch = match.group()
    return {"\n": "\\n", "\r": "\\r"}.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")


def comment(lines: list[str], marker: str = "#") -> str:
    """Comment lines; each value is kept on its own line (:func:`one_line`)."""
    return "".join(f"{marker} {one_line(line)}".rstrip() + "\n" for line in lines)
