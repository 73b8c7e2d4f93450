"""The runnable script (``train.py``), its launcher (``launch.sh``) and, for multi-node DeepSpeed,
the ``hostfile``.

train.py is the template ``templates/train.py.tmpl`` with two things filled in: the header and the
``PLAN`` mapping (method, LoRA, quantization, precision, the Trainer's optimizer name,
checkpointing, attention, shape). Everything else in it is fixed code, so a plan changes only data.
"""

from __future__ import annotations

from importlib import resources

from ..estimator.knobs import IN_BACKWARD_OPTIMIZERS
from ..setup.max_memory import max_memory_map
from ..specs import ModelSpec, Plan, SpecError
from .common import MODEL_CONFIG, comment, default_lr, header_lines, launch_commands, plan_model, uses_deepspeed

#: vramplan optimizer -> TrainingArguments.optim (transformers' OptimizerNames).
TRAINER_OPTIM = {
    "adamw": "adamw_torch",
    "adamw-fused": "adamw_torch_fused",
    "adamw-8bit": "adamw_bnb_8bit",
    "paged-adamw-8bit": "paged_adamw_8bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "lion": "lion_32bit",
}


def _hub_id(plan: Plan, model: ModelSpec | None = None) -> str | None:
    """The model's Hub id when the plan names one (what ``--model`` would load real weights from)."""
    model = model or plan_model(plan)
    if model.source.startswith(("profile:", "hub:")):
        return model.name
    return None


def script_plan(plan: Plan, model: ModelSpec | None = None) -> dict:
    """The ``PLAN`` mapping train.py reads: the Setup in the words of transformers/peft (LoRA and
    quantization keys only where the plan uses them). ``model``: the plan's ModelSpec, if known."""
    s = plan.setup
    if s.optimizer_in_backward and s.optimizer not in IN_BACKWARD_OPTIMIZERS:
        raise SpecError(f"optimizer_in_backward is emitted for the HF Trainer with torch's optimizers only "
                        f"({', '.join(IN_BACKWARD_OPTIMIZERS)}): one per parameter, as transformers 5.24 builds "
                        f"its layer-wise ones; {s.optimizer} needs a whole-model optimizer (bitsandbytes' module "
                        "overrides, Adafactor's factored states): use --optimizer adamw or plan without it")
    data: dict = {"model": _hub_id(plan, model) or "ID_OR_PATH", "method": s.method}
    if s.adapters:
        data.update(lora_r=s.lora_rank, lora_alpha=s.alpha, lora_dropout=s.lora_dropout, lora_targets=s.lora_targets)
        if s.modules_to_save.strip():  # LoraConfig(modules_to_save=[...]): names the estimate accepted
            data["modules_to_save"] = [m.strip() for m in s.modules_to_save.split(",") if m.strip()]
        if s.dora:
            data["dora"] = True  # LoraConfig(use_dora=True)
    data["quant"] = s.quant
    if s.quant in ("gptq", "awq"):
        data.update(quant_bits=s.quant_bits, quant_group_size=s.quant_group_size)
    elif s.quant != "none":
        data["double_quant"] = s.double_quant
        if s.quant in ("nf4", "fp4"):
            data["quant_storage"] = quant_storage(s)
        if getattr(s, "fsdp", "none") not in ("none", None):
            data["fsdp"] = s.fsdp  # train.py skips prepare_model_for_kbit_training under FSDP
    data.update(
        precision=s.precision,
        optim=TRAINER_OPTIM[s.optimizer],
        lr=default_lr(s),
        checkpointing=s.checkpointing,
        # activation_checkpointing_kwargs={"every_n_layers": k}: transformers 5.24 checkpoints layers i % k == 0
        **({"checkpoint_every": s.checkpoint_every} if s.checkpointing and s.checkpoint_every > 1 else {}),
        attn=s.attn,
        loss=s.loss,
        **({"liger": True} if s.liger else {}),  # Trainer(use_liger_kernel=True)
        # training_step under TRL's get_act_offloading_ctx_manager, as SFTTrainer (train.py OffloadingTrainer)
        **({"activation_offload": True} if s.activation_offload else {}),
        **({"padding_free": True} if s.padding_free else {}),  # DataCollatorWithFlattening
        # one optimizer per parameter stepped by its post-accumulate-grad hook, handed to the Trainer as
        # transformers 5.24's LayerWiseDummyOptimizer (train.py in_backward_optimizer)
        **({"optimizer_in_backward": True} if s.optimizer_in_backward else {}),
        # from_pretrained(device_map=...): the layers split over this process's GPUs
        **({"device_map": s.device_map} if s.device_map != "none" else {}),
        # from_pretrained(max_memory={GPU index: bytes}): accelerate's caps as data (vramplan/setup/max_memory.py)
        **({"max_memory": max_memory_map(s.max_memory)} if s.max_memory else {}),
        # from_pretrained(distributed_config=DistributedConfig(tp_plan="auto")): each process a 1/tp shard
        **({"tp": s.tp} if s.tp > 1 else {}),
        # beside FSDP2: DistributedConfig(fsdp_size=gpus / tp), transformers shards both at load (tp_fsdp2.py)
        **({"fsdp_size": s.gpus // s.tp} if s.tp > 1 and s.fsdp != "none" else {}),
        batch=s.batch,
        seq=s.seq,
        grad_accum=s.grad_accum,
        # parameters partitioned across GPUs (ZeRO-3, FSDP): 4-bit weights are stored in bf16 then
        sharded=s.zero_stage == 3 or getattr(s, "fsdp", "none") not in ("none", None),
    )
    if s.eval_batch:  # per_device_eval_batch_size with eval_strategy="steps" (estimator/eval_step.py)
        data["eval_batch"] = s.eval_batch
    if s.objective != "sft":  # DPO/GRPO (trl_objective.py): lengths and reference as the estimate read them
        from ..estimator.objectives import lengths, reference

        lens = lengths(s)
        data.update(objective=s.objective, ref_model=reference(s), prompt_length=lens.prompt,
                    completion_length=lens.completion, num_generations=s.num_generations, beta=0.04,
                    generation=s.generation, vllm_memory_fraction=s.vllm_memory_fraction)
    return data


def objective_script() -> str:
    """trl_objective.py: the DPOTrainer / GRPOTrainer train.py builds for a DPO/GRPO plan."""
    return (resources.files("vramplan.emit") / "templates" / "trl_objective.py.tmpl").read_text(encoding="utf-8")


def quant_storage(s) -> str:
    """The dtype bitsandbytes packs 4-bit weights into (``bnb_4bit_quant_storage``). Unsharded:
    uint8. ZeRO-3 partitions them as parameters and DeepSpeed casts every parameter to its 16-bit
    dtype at ``initialize`` (an fp32 storage would be cast element-wise, breaking the packing):
    the 16-bit compute dtype. FSDP flattens them with the other weights of a unit: the load dtype
    (fp32 for fp32; Setup refuses a -mixed QLoRA under FSDP: its MixedPrecision would cast the
    fp32-packed weights to 16 bits element by element)."""
    if s.zero_stage == 3:
        return "float16" if s.precision.startswith("fp16") else "bfloat16"
    if getattr(s, "fsdp", "none") not in ("none", None):
        return {"bf16": "bfloat16", "fp16": "float16"}.get(s.precision, "float32")
    return "uint8"


def train_script(plan: Plan, model: ModelSpec | None = None) -> str:
    """The text of train.py for ``plan`` (``model``: the plan's ModelSpec, if known)."""
    template = (resources.files("vramplan.emit") / "templates" / "train.py.tmpl").read_text(encoding="utf-8")
    model = model or plan_model(plan)
    real = _hub_id(plan, model) or "ID_OR_PATH"
    runs = f"random weights from {MODEL_CONFIG}; real weights: add --model {real}"
    if plan.setup.quant in ("gptq", "awq"):
        runs = (f"needs --model: a pre-quantized {plan.setup.quant_bits}-bit {plan.setup.quant.upper()} checkpoint "
                f"of {real} (random weights cannot be {plan.setup.quant.upper()}-quantized here)")
    header = comment(header_lines(plan, runs=runs))
    body = "{\n" + "".join(f"    {key!r}: {value!r},\n" for key, value in script_plan(plan, model).items()) + "}"
    return template.replace("__HEADER__\n", header).replace("__PLAN__", body)


def launch_script(plan: Plan) -> str:
    """launch.sh: runs the plan's preferred command from the emitted directory, passing on its
    arguments (``./launch.sh --max-steps 100``)."""
    lines = ["#!/usr/bin/env bash", *comment(header_lines(plan)).splitlines(), "set -euo pipefail",
             'cd "$(dirname "$0")"']
    if plan.nodes > 1:
        lines.append(': "${MAIN_IP:?set MAIN_IP to the address of node 0}"')
        if not uses_deepspeed(plan):
            lines.append(f': "${{NODE_RANK:?set NODE_RANK to this node\'s rank, 0 to {plan.nodes - 1}}}"')
    lines.append(f'exec {launch_commands(plan)[0]} "$@"')
    return "\n".join(lines) + "\n"


def hostfile(plan: Plan) -> str:
    """DeepSpeed's hostfile for a multi-node plan: one line per node (replace the host names)."""
    lines = comment(["one line per node: host name (as ssh reaches it) and its GPUs; replace the names"])
    return lines + "".join(f"node-{i} slots={plan.gpus_per_node}\n" for i in range(plan.nodes))
