"""`vramplan plan`: the fastest setup that fits a target, the trade-offs, and why the others fail.

Every setup option is a *fixed knob* when given and a *free knob* (searched) when not, so the
options here default to None instead of the canonical step's values that ``setup_options`` uses
(the same option table, :data:`vramplan.commands.options.SETUP_OPTIONS`, with plan's own help).
The search is :func:`vramplan.search.plan`; this module parses, prints and writes files. No torch.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import click

from ..setup.frameworks import with_framework_defaults
from ..setup.wording import describe
from ..specs import Setup, SpecError
from .from_config import from_options
from .options import (
    FLAG,
    Count,
    calibration_options,
    corrections_for,
    given_fields,
    gpu_options,
    knob_options,
    prequantized_knobs,
    print_json,
    setting_option,
    stack_for,
    transformers_option,
    user_errors,
    warn_lora_unused,
)

#: Plan keyword -> the flag a user typed, for error messages.
_PLAN_FLAG = {**FLAG, "global_batch": "--global-batch", "tokens_per_step": "--tokens-per-step",
              "dataset_tokens": "--dataset-tokens", "nodes": "--nodes", "host_ram": "--host-ram", "margin": "--margin",
              "lora_rank": "--lora-rank"}

_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_COUNT_MULT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str | None, flag: str) -> int | None:
    """``"100M"``, ``"1.5B"``, ``"2e9"`` or ``"4096"`` -> an int (decimal suffixes)."""
    if text is None:
        return None
    m = _COUNT_RE.match(text)
    try:
        value = float(m.group(1)) * _COUNT_MULT[m.group(2).lower()] if m else float(text)
    except ValueError:
        raise SpecError(f"{flag}: cannot read {text!r} as a count; write e.g. 4096, 100M or 1.5B") from None
    shown = text if len(text) <= 40 else text[:37] + "..."
    if not value >= 1 or value == float("inf") or value != int(value):
        raise SpecError(f"{flag} must be a positive whole number; got {shown!r}")
    from ..setup.inputs import check_count

    return check_count(flag.lstrip("-").replace("-", "_"), int(value), flag)


def _flagged(message: str) -> str:
    field = message.split(" ", 1)[0]
    return _PLAN_FLAG[field] + message[len(field):] if field in _PLAN_FLAG else message


#: The setup options plan takes as knobs, in --help order (--no-quant between the two groups), and
#: their help: a knob given is fixed, one left out is searched (or takes the default named).
_KNOBS = {
    "method": "Fix the method  [default: searched]",
    "lora_alpha": "LoRA alpha  [default: 2 x rank]",
    "lora_dropout": "LoRA dropout  [default: 0.0]",
    "lora_targets": "'all-linear' or comma-separated module names.",
    "quant": "Fix the base quantization  [default: searched]",
}
_MORE_KNOBS = {
    "double_quant": "4-bit scales quantized too  [default: yes]",
    "quant_bits": "GPTQ/AWQ bits per weight  [default: 4]",
    "quant_group_size": "GPTQ/AWQ input channels per group, -1 per channel  [default: 128]",
    "precision": "[default: bf16, or fp16 on cards without bf16]",
    "optimizer": "[default: searched: adamw-fused or adamw-8bit]",
    "checkpointing": "[default: searched]",
    "attn": "[default: searched]",
    "zero_stage": "Fix the ZeRO stage  [default: searched]",
    "offload_optimizer": "[default: searched]",
    "offload_params": "[default: searched]",
    "fsdp": "Fix PyTorch FSDP sharding instead of ZeRO (none: no FSDP)  [default: searched on several GPUs]",
    "fsdp_version": "accelerate fsdp_version: 2 fixes FSDP2 (fully_shard; needs --fsdp)  [default: 1]",
    "dp_replicate": "Hybrid sharding: FSDP shards within --gpus/N GPUs, N replicas (needs --fsdp)  [default: 1]",
    "loss": "[default: the framework's: hf, or trl's fused head with --framework trl]",
    "framework": "The framework that runs the step (hf, trl, axolotl, llamafactory): its model preparation; "
                 "ZeRO/FSDP are searched with hf only; any: plan each, take the best and say why  [default: hf]",
    "liger": "Liger kernels  [default: searched where modelled, chosen only when a plain stack does not fit]",
    "dora": "DoRA adapters (peft use_dora)  [default: no]",
    "modules_to_save": "Modules trained in full beside the adapters, e.g. embed_tokens,lm_head  [default: none]",
    "batch": "Fix the micro-batch per GPU  [default: searched]",
    "grad_accum": "Fix the gradient accumulation  [default: from the global batch]",
    "objective": "Training objective as TRL runs it  [default: sft]",
    "max_prompt_length": "DPO/GRPO prompt tokens  [default: from --seq]",
    "max_completion_length": "DPO/GRPO completion tokens  [default: from --seq]",
    "num_generations": "GRPO completions per prompt  [default: 8]",
    "ref_model": "DPO/GRPO reference model  [default: auto]",
    "generation": "GRPO generation engine  [default: hf]",
    "vllm_memory_fraction": "GRPO vLLM colocated share of the card  [default: 0.3]",
    "eval_batch": "Per-device eval batch of the run's evals, judged as its own phase  [default: 0: no eval]",
    "compile": "torchtune's compile: True, its compiled loss (--framework torchtune)  [default: no]",
    "tiled_mlp": "the MLP in sequence tiles: Unsloth's unsloth_tiled_mlp=True, axolotl's tiled_mlp  "
                 "[default: searched for unsloth and axolotl, chosen only when the plain step does not fit]",
    "unsloth_gc": "LLaMA-Factory's use_unsloth_gc, the checkpointed layer inputs in host RAM  "
                  "[default: searched for llamafactory]",
}


@click.command()
@click.argument("model", required=False)
@from_options
@gpu_options
@setting_option("gpus", "GPUs in all (data parallel).")
@click.option("--nodes", type=Count("nodes"), default=1, show_default=True,
              help="Machines the GPUs are split over evenly.")
@click.option("--host-ram", metavar="SIZE",
              help="Host RAM per node for CPU offload, e.g. 128GiB  [default: this machine's when it holds the GPU, "
                   "else the GPU profile's typical host]")
@click.option("--margin", metavar="SHARE", type=float, default=0.10, show_default=True,
              help="Share of usable GPU memory a plan leaves free (on top of the estimate's error band).")
@click.option("--nvme", is_flag=True, help="Allow DeepSpeed NVMe offload (ZeRO-Infinity).")
@setting_option("seq")
@click.option("--global-batch", metavar="N", help="Sequences per optimizer step over all GPUs  [default: free]")
@click.option("--tokens-per-step", metavar="N", help="Tokens per optimizer step (e.g. 1M); sets the global batch.")
@click.option("--dataset-tokens", metavar="N", help="Training tokens (e.g. 500M): the run's hours and dollars.")
@click.option("--epochs", type=Count("epochs"), default=1, show_default=True, help="Passes over --dataset-tokens.")
@click.option("--max-gpus", type=Count("max-gpus"), default=8, show_default=True,
              help="With --gpu any/consumer/cloud/A,B: the most GPUs a row uses (1, 2, 4, 8, then nodes of 8).")
@click.option("--rank-by", type=click.Choice(["cost", "time"]), default="cost", show_default=True,
              help="With several cards: order the rows by dollars or by hours.")
@click.option("--budget", metavar="USD", type=float, help="With several cards: drop the rows that cost more.")
@click.option("--deadline", metavar="HOURS", type=float, help="With several cards: drop the rows that take longer.")
@click.option("--price", "price_args", metavar="NAME=USD", multiple=True,
              help="US dollars per GPU-hour of a card, over the shipped table (repeatable).")
@click.option("--prices", "prices_file", metavar="FILE", help="A YAML/JSON table of GPU name -> USD per GPU-hour.")
@click.option("--lora-rank", "lora_rank", metavar="N|LO..HI",
              help="LoRA rank (a quality setting the search never raises), or a range it picks in by speed  "
                   "[default: 16]")
@knob_options(_KNOBS)
@click.option("--no-quant", is_flag=True, help="Same as --quant none: an unquantized base.")
@knob_options(_MORE_KNOBS)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option("--out", "out_file", metavar="FILE", help="Write the plan file (.yaml, .yml or .json).")
@click.option("--html", "html_file", metavar="FILE", help="Write a standalone HTML report.")
@click.option("--emit", "emit_dir", metavar="DIR",
              help="Write the launch files (`vramplan emit`) into DIR; with --from FILE, FILE written back with "
                   "the plan's changes (each commented) instead.")
@click.option("--force", is_flag=True, help="Overwrite an existing --out/--html file or non-empty --emit DIR.")
@calibration_options
@transformers_option
@user_errors
def plan(model: str | None, from_file: str | None, config_format: str | None, accelerate_file: str | None,
         gpu_name: str | None, gpu_memory: str | None, gpus: int, nodes: int, host_ram: str | None,
         margin: float, nvme: bool, seq: int, global_batch: str | None, tokens_per_step: str | None,
         dataset_tokens: str | None, epochs: int, max_gpus: int, rank_by: str, budget: float | None,
         deadline: float | None, price_args: tuple[str, ...], prices_file: str | None,
         no_quant: bool, as_json: bool, out_file: str | None, html_file: str | None, emit_dir: str | None,
         force: bool, **knobs: Any) -> None:
    """The setup of MODEL to run on the GPU, its alternatives, and why the others fail.

    Setup options given are kept fixed; the others are searched (method, quantization, optimizer,
    checkpointing, attention, ZeRO stage, FSDP, offload, micro-batch x grad accumulation). The plan
    keeps the GPU resident when it can, takes the best quality tier that fits with margin (full >
    LoRA > LoRA on an 8-bit base > QLoRA), then the most tokens/s.

    --from FILE plans from a training config: its setup is estimated as written, and the plan
    keeps its model, GPUs, sequence length, global batch and quality choices, searches the memory
    savers, and prints what it changes.
    """
    from ..search import plan as run_plan
    from ..setup.inputs import resolve_gpu
    from ..util.units import parse_bytes
    from .fleet import is_fleet, plan_fleet, price_table, run_json, run_line

    stack = stack_for(knobs.pop("transformers_version"))  # every candidate is estimated (and costed) under it
    tokens = parse_count(dataset_tokens, "--dataset-tokens")
    table = price_table(price_args, prices_file) if (tokens or price_args or prices_file) else None
    if is_fleet(gpu_name):  # several cards: the run on each card and count (search/fleet.py)
        if from_file or gpu_memory or out_file or emit_dir:
            raise SpecError("--gpu with several cards compares runs: --from, --gpu-memory, --out and --emit take one "
                            "card")
        _refuse_overwrites(None, html_file, None, force)
        if model is None:
            raise SpecError("plan needs MODEL (a model name, Hub id or config.json)")
        corr_off, corr_file = knobs.pop("no_calibration"), knobs.pop("calibration_file")
        if corr_off or corr_file:
            raise SpecError("--gpu with several cards applies each card's calibration: drop --no-calibration and "
                            "--calibration")
        fixed = with_framework_defaults({k: v for k, v in knobs.items() if v is not None})
        if no_quant:
            fixed["quant"] = "none"
        plan_fleet(model, gpu_name, dataset_tokens=tokens, epochs=epochs, max_gpus=max_gpus, rank_by=rank_by,
                   budget=budget, deadline=deadline, table=table, as_json=as_json, html_file=html_file,
                   plan_kwargs={"seq": seq, "margin": margin, "nvme": nvme,
                                "global_batch": parse_count(global_batch, "--global-batch"),
                                "tokens_per_step": parse_count(tokens_per_step, "--tokens-per-step"),
                                "stack": stack},
                   fixed=fixed)
        return
    gpu = resolve_gpu(gpu_name, gpu_memory)
    if gpu is None:
        raise SpecError("plan needs a target: pass --gpu NAME or --gpu-memory SIZE")
    _refuse_overwrites(out_file, html_file, emit_dir, force)  # before any work, so nothing is half-written
    if no_quant:
        if knobs.get("quant") not in (None, "none"):
            raise SpecError(f"pass --quant {knobs['quant']} or --no-quant, not both")
        knobs["quant"] = "none"
    ram = None
    if host_ram is not None:
        try:
            ram = parse_bytes(host_ram)
        except (ValueError, OverflowError) as exc:
            raise SpecError(f"--host-ram: {exc}") from None
    corrections = corrections_for(gpu, knobs.pop("no_calibration"), knobs.pop("calibration_file"))
    fixed = {k: v for k, v in knobs.items() if v is not None}
    fixed = with_framework_defaults(fixed)  # --framework trl: its fused head unless --loss says otherwise
    warn_lora_unused(fixed.get("method"), fixed)
    batch_count = parse_count(global_batch, "--global-batch")
    source = None
    if from_file is not None:
        from ..estimator import estimate
        from ..model.profiles import load_model
        from ..readers import merge_fixed
        from .from_config import plan_source, print_as_written

        typed = set(given_fields(["gpus", "seq"]))
        read, source = plan_source(from_file, config_format, model, accelerate_file,
                                   gpus if "gpus" in typed else None, gpu)
        model, gpus = source.model, source.gpus
        seq = seq if "seq" in typed else source.seq
        if batch_count is None and tokens_per_step is None and "batch" not in fixed and "grad_accum" not in fixed:
            batch_count = source.global_batch
        from ..emit.frameworks import framework_limits

        fixed = merge_fixed({**framework_limits(read.format), **source.fixed}, fixed)  # what the framework runs
        as_written = estimate(load_model(model), source.setup, gpu, corrections, stack)
        if not as_json:
            print_as_written(read, source, as_written)
    elif config_format or accelerate_file:
        raise SpecError("--format and --accelerate-config go with --from FILE")
    elif model is None:
        raise SpecError("plan needs MODEL (a model name, Hub id or config.json) or --from FILE (a training config)")
    else:  # a re-upload or pre-quantized upload: the note, and the quantization its name says unless fixed
        fixed = {**fixed, **prequantized_knobs(model, fixed)}
    ram_source = "given"
    if ram is None:  # this machine's RAM when it holds the card (vramplan.plan() never reads the machine)
        from ..search.planner import local_host_ram

        ram = local_host_ram(gpu, nodes if isinstance(nodes, int) else 1)
        ram_source = "local"
    try:
        result = run_plan(model, gpu, gpus=gpus, nodes=nodes, host_ram=ram, nvme=nvme, seq=seq, margin=margin,
                          host_ram_source=ram_source, global_batch=batch_count,
                          tokens_per_step=parse_count(tokens_per_step, "--tokens-per-step"),
                          dataset_tokens=tokens * epochs if tokens else None, corrections=corrections,
                          stack=stack, **fixed)
    except SpecError as exc:
        raise SpecError(_flagged(str(exc))) from None

    from ..plans.planfile import plan_to_json, save_plan

    if out_file:
        save_plan(result, out_file)
    if html_file:
        from ..plans.report import write_html

        write_html(result, html_file)
    emitted = []
    if emit_dir:
        if not result.fits:
            raise SpecError(f"nothing fits, so there is nothing to emit into {emit_dir}")
        from ..emit import (  # the emitters are torch-free too
            emit_to_dir,
            launch_command,
        )
        from ..model.profiles import load_model

        # the search resolved MODEL (cached): the emitters reuse its spec instead of the plan's name
        if source is not None:  # the user's own file, only the changed fields changed
            from ..emit import write_back_to_dir

            emitted = write_back_to_dir(read, source.setup, result, emit_dir, force=force, model=load_model(model),
                                        as_written=as_written)
        else:
            emitted = emit_to_dir(result, emit_dir, formats=None, force=force, model=load_model(model))
    run = run_json(result, tokens, epochs, table) if tokens else None
    if as_json:
        out = plan_to_json(result)
        if tokens:
            out["run"] = run
        if source is not None:
            from ..readers import setup_changes
            from .from_config import as_written_json

            out["from_config"] = {**as_written_json(read, source, as_written),
                                  "changes": [c.to_json() for c in setup_changes(source.setup, result.setup)]}
        print_json(out)
    else:
        print_plan(result)
        if run_line(run):
            click.echo(run_line(run))
        if source is not None:
            from ..readers import setup_changes
            from .from_config import print_changes

            print_changes(from_file, setup_changes(source.setup, result.setup), result.fits)
    for path in [out_file, html_file, *emitted]:
        if path:
            click.echo(f"wrote {path}", err=True)
    if emitted and source is None:
        click.echo(f"run: cd {shlex.quote(emit_dir)} && {launch_command(result)}", err=True)


def _refuse_overwrites(out_file: str | None, html_file: str | None, emit_dir: str | None, force: bool) -> None:
    """Every file plan would write, checked before it writes any: an existing file (or a
    non-empty --emit DIR) needs --force, and no two outputs may be the same path."""
    from pathlib import Path

    from ..util.fileio import refuse_existing

    paths = [p for p in (out_file, html_file) if p]
    if len({str(Path(p).resolve()) for p in paths}) < len(paths):
        raise SpecError("--out and --html name the same file")
    for flag, path in (("--out", out_file), ("--html", html_file)):
        if path:
            refuse_existing(path, force, flag)
    if emit_dir:
        from ..emit import check_out_dir

        check_out_dir(emit_dir, force)


def _data_ranks(s: Setup) -> str:
    """How the GPUs share a step: data-parallel ranks, and the ones that split one micro-batch (a layer
    split's one process, tensor parallelism's shards of every layer, context parallelism's sequence)."""
    if s.gpus == 1:
        return ""
    if s.device_map != "none":
        return "; one process, the layers split over the GPUs"
    groups = s.gpus // (s.tp * s.cp)
    out = f" x {groups} GPUs" if s.tp * s.cp == 1 else (f" x {groups} data-parallel groups" if groups > 1 else "")
    out += f"; tensor parallelism: {s.tp} GPUs share each micro-batch" if s.tp > 1 else ""
    out += f"; context parallelism: each sequence split over {s.cp} GPUs" if s.cp > 1 else ""
    return out


def _step_rows(setup, global_batch: int) -> str:
    """What one step trains on: SFT sequences; DPO pairs (chosen + rejected rows); GRPO prompts x
    generations rows of prompt + completion (the rows tokens/s counts, vramplan/cost/objectives.py)."""
    if setup.objective == "sft":
        return f"{global_batch} x {setup.seq} tokens"
    from ..estimator.objectives import lengths

    lens = lengths(setup)
    if setup.objective == "grpo":
        return (f"{global_batch} prompt{'s' if global_batch != 1 else ''} x {setup.num_generations} completions of "
                f"{lens.prompt} + {lens.completion} tokens")
    return f"{global_batch} x {lens.rows // max(setup.batch, 1)} rows of {lens.row_len} tokens"


def print_plan(plan) -> None:
    """The human-readable plan: verdict, memory bar, speed, alternatives, why-not lines, notes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..plans.report import terminal_bar, terminal_legend
    from ..search import savers_text

    console = Console(highlight=False)
    bd, gpu = plan.breakdown, plan.gpu
    usable = gpu.usable_memory_bytes
    tight = plan.tight
    gpus = f"{plan.setup.gpus} x " if plan.setup.gpus > 1 else ""
    nodes = f" over {plan.nodes} nodes" if plan.nodes > 1 else ""
    verdict = ("[bold red]does not fit[/]" if not plan.fits else "[bold yellow]fits, tight[/]" if tight
               else "[bold green]fits[/]")
    console.print(f"[bold]{escape(plan.model)}[/] on {gpus}{escape(gpu.display_name)}{nodes} "
                  f"({usable / 2**30:.1f} GiB usable): {verdict}")
    label = "plan" if plan.fits else "closest"
    console.print(f"{label}: {escape(describe(plan.setup))}")
    console.print(terminal_bar(bd), f" {bd.device_total_bytes / 2**30:.1f} / {usable / 2**30:.1f} GiB")
    console.print(terminal_legend(bd, console.width))
    if plan.fits:
        share = bd.headroom_bytes / usable if usable else 0.0
        console.print(f"headroom {bd.headroom_bytes / 2**30:.1f} GiB ({share:.0%}) · peak in {bd.phase}"
                      + (f" · host RAM {bd.host_bytes / 2**30:.1f} GiB per GPU" if bd.host_bytes else "")
                      + (f" · NVMe {nvme / 2**30:.1f} GiB per GPU" if (nvme := bd.component("nvme_offload")) else ""))
        console.print(f"speed: ~{plan.tokens_per_s:,.0f} tokens/s · {plan.step_time_s:.2f} s per step of "
                      f"{_step_rows(plan.setup, plan.global_batch)} (micro-batch {plan.setup.batch} x grad accum "
                      f"{plan.setup.grad_accum}{_data_ranks(plan.setup)})")
    if plan.alternatives:
        table = Table(title="alternatives (Pareto: memory · speed · quality)", title_justify="left",
                      show_edge=False, pad_edge=False)
        for col, kw in (("quality", {"no_wrap": True}), ("GiB", {"justify": "right"}),
                        ("tokens/s", {"justify": "right"}), ("batch", {"justify": "right"}), ("memory savers", {}),
                        ("vs chosen", {})):
            table.add_column(col, **kw)
        for a in plan.alternatives:
            table.add_row(a.quality, f"{a.device_total_bytes / 2**30:.1f}", f"{(a.tokens_per_s or 0):,.0f}",
                          f"{a.setup.batch}x{a.setup.grad_accum}", savers_text(a.setup), a.note)
        console.print(table)
    if plan.rejected:
        console.print("[bold]why not[/]")
        for r in plan.rejected:
            console.print(f"  ✗ {escape(r.reason)}")
    for note in plan.notes:
        what_would = not plan.fits and note.kind == "what_would_fit"
        console.print(f"  → {escape(note)}" if what_would else f"[dim]note: {escape(note)}[/]")
