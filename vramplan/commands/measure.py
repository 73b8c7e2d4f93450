"""`vramplan measure`, `vramplan sweep`, `vramplan calibrate`: real runs, and what they teach the estimator.

- ``measure PLAN|MODEL``: emit the plan's files, run its train.py for a few steps in a fresh
  process, print estimate vs measured and append the record to ``calibration/measurements/``;
- ``sweep MATRIX.yaml --budget 8m``: many measurements, most informative first, within a budget;
- ``calibrate``: fit the device corrections from the records into ``calibration/coefficients.json``.

Light at import (click and torch-free vramplan modules); only the worker process imports torch.
"""

from __future__ import annotations

import click

from ..setup.wording import describe
from ..specs import SpecError
from ..util.units import fmt_bytes
from .options import (
    FLAG,
    SETUP_FIELDS,
    given_fields,
    gpu_options,
    print_json,
    setup_options,
    user_errors,
    warn,
)


def _gib(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n, digits=3)


def _is_plan_file(target: str) -> bool:
    from pathlib import Path

    path = Path(target)
    if not path.is_file() or path.suffix not in (".json", ".yaml", ".yml"):
        return False
    if path.suffix != ".json":  # a model's config is JSON: YAML can only be a plan file
        return True
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return "vramplan_plan" in text


def _given_setup_flags() -> list[str]:
    return [FLAG[k] for k in given_fields(SETUP_FIELDS)]


def _parse_size(text: str | None, flag: str) -> int | None:
    from ..util.units import parse_bytes

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except (ValueError, OverflowError) as exc:
        raise SpecError(f"{flag}: {exc or f'cannot read {text!r}'}") from None


def _missing_libraries(setups) -> list[str]:
    """The worker's libraries these setups need that are not installed (found without importing
    them: this process stays torch-free)."""
    import importlib.util

    needed = ["torch", "transformers", "accelerate"]
    if any(s.adapters for s in setups):
        needed.append("peft")
    if any(s.quant != "none" or "8bit" in s.optimizer or s.optimizer == "lion" for s in setups):
        needed.append("bitsandbytes")
    if any(s.zero_stage for s in setups):
        needed.append("deepspeed")
    return [name for name in needed if importlib.util.find_spec(name) is None]


def _require_run_extra(setups) -> None:
    """Fail in one line, before anything runs or is recorded, when the worker's libraries are not
    installed."""
    missing = _missing_libraries(setups)
    if missing:
        raise SpecError(f"measuring needs the optional extra: pip install 'vramplan[run]' ({', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing)")


def print_measurement(m) -> None:
    """Estimate vs measured, one row per headline quantity (what a user reads after a run)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..calibration.measure import comparison, cpu_comparable

    console = Console()
    where = m.provenance.get("gpu_name") or m.device
    if m.emulate_gpu:
        where += f" emulating {m.emulate_gpu}"
    console.print(f"[bold]{escape(m.model)}[/]  {escape(describe(m.setup))}  on {escape(str(where))}")
    meas = m.measured
    if meas.get("failed"):
        where = f" (in {meas['phase']}, step {meas.get('step')})" if meas.get("phase") else ""
        console.print(f"[red]failed[/]: {escape(str(meas.get('error')))}{where}")
        return
    if meas.get("oom"):
        console.print(f"[red]out of memory[/] in {meas.get('oom_phase')} (step {meas.get('oom_step')})")
    table = Table(box=None)
    for col in ("quantity", "estimate", "measured", "error"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for key, row in comparison(m).items():
        table.add_row(key, _gib(row["estimate"]), _gib(row["measured"]), f"{row['error']:+.1%}")
    console.print(table)
    if m.device == "cpu" and cpu_comparable(m.setup):
        console.print(f"tensor_peak_bytes {_gib(meas.get('tensor_peak_bytes'))} not compared: "
                      f"{cpu_comparable(m.setup)}")
    extras = [(k, meas.get(k)) for k in ("active_peak_bytes", "cuda_context_bytes", "peak_rss_bytes")]
    console.print("  ".join(f"{k} {_gib(v)}" for k, v in extras if v is not None))
    if meas.get("tokens_per_s"):
        console.print(f"step {meas['step_time_s']:.3f} s, {meas['tokens_per_s']:.0f} tokens/s")


@click.command()
@click.argument("target", metavar="PLAN|MODEL")
@setup_options
@gpu_options
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--steps", type=int, default=3, show_default=True,
              help="Optimizer steps (live tensors are counted over the first two).")
@click.option("--emulate-gpu", default=None, metavar="NAME",
              help="Cap the CUDA allocator to this card's usable memory (e.g. rtx-4090); an OOM means it does not fit.")
@click.option("--cpu-memory-cap", default=None, metavar="SIZE",
              help="CPU emulation of a card: live tensor bytes past SIZE are an out-of-memory (e.g. 20MiB).")
@click.option("--scale-down", is_flag=True,
              help="Scale the model down (2 layers, hidden 256, vocab 4096) for a quick CPU run.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Seconds before the run is killed.")
@click.option("--record/--no-record", default=True, show_default=True, help="Append the record to --records.")
@click.option("--records", "records_dir", default="calibration/measurements", show_default=True,
              type=click.Path(file_okay=False), help="Directory of the .jsonl records.")
@click.option("--keep", "keep_dir", default=None, type=click.Path(file_okay=False),
              help="Keep the emitted files and the worker's logs in this directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@user_errors
def measure(target: str, setup, gpu_name, gpu_memory, device: str, steps: int, emulate_gpu: str | None,
            cpu_memory_cap: str | None, scale_down: bool, timeout_s: float, record: bool, records_dir: str,
            keep_dir: str | None, as_json: bool) -> None:
    """Run PLAN (a plan file) or MODEL with the setup options for real, and measure its memory.

    The plan's files are emitted to a temporary directory and its train.py runs in a fresh process
    for --steps steps on random weights and synthetic tokens. OOM is a result (exit 0); a crash or
    a timeout is recorded and exits 1.
    """
    import dataclasses

    from ..calibration import measure as m
    from ..estimator import estimate
    from ..model.profiles import load_gpu, load_model
    from ..plans.planfile import load_plan
    from ..setup.inputs import resolve_gpu
    from ..specs import Plan

    options = m.MeasureOptions(
        device=device, steps=steps, timeout_s=timeout_s,
        emulate_gpu=load_gpu(emulate_gpu) if emulate_gpu else None,
        cpu_memory_cap_bytes=_parse_size(cpu_memory_cap, "--cpu-memory-cap"), keep_dir=keep_dir)
    gpu = resolve_gpu(gpu_name, gpu_memory)
    if _is_plan_file(target):
        if _given_setup_flags():
            raise SpecError(f"{', '.join(sorted(_given_setup_flags()))}: a plan file fixes its setup; "
                            "setup options apply to MODEL")
        plan = load_plan(target)
        if gpu is not None:
            plan = dataclasses.replace(plan, gpu=gpu)
        model_ref = plan.model
    else:
        load_model(target)  # a one-line error for an unknown model before anything runs
        plan, model_ref = None, target
    m.check_measurable(plan.setup if plan is not None else setup)
    _require_run_extra([plan.setup if plan is not None else setup])
    scale = dict(m.DEFAULT_SCALE) if scale_down else None
    from ..util.fileio import TempDir

    with TempDir("scaled") as tmp:
        if scale:
            scaled = m.scaled_model_path(model_ref, scale, tmp)
            base = plan or Plan(model=scaled, setup=setup, breakdown=estimate(load_model(scaled), setup, gpu), gpu=gpu)
            plan = dataclasses.replace(base, model=scaled,
                                       breakdown=estimate(load_model(scaled), base.setup, base.gpu))
        elif plan is None:
            plan = Plan(model=target, setup=setup, breakdown=estimate(load_model(target), setup, gpu), gpu=gpu)
        result = m.measure_plan(plan, options, model_ref=model_ref, scale=scale)
    path = m.save(result, records_dir) if record else None
    if as_json:
        print_json({**result.to_json(), "comparison": m.comparison(result)})
    else:
        print_measurement(result)
        if path is not None:
            click.echo(f"recorded in {path}")
    if result.measured.get("failed"):
        warn(f"measurement failed: {result.measured.get('error')}")
        raise SystemExit(1)


@click.command()
@click.argument("matrix", type=click.Path(dir_okay=False))
@click.option("--budget", default="8m", show_default=True, help="Time budget: 90s, 8m, 1h.")
@click.option("--records", "records_dir", default="calibration/measurements", show_default=True,
              type=click.Path(file_okay=False), help="Directory of the .jsonl records (read to skip, appended to).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Override the matrix's device.")
@click.option("--dry-run", is_flag=True,
              help="List the runs in order, with their predicted seconds, without running them.")
@click.option("--skip-unavailable", is_flag=True,
              help="Leave out the runs whose libraries (bitsandbytes, deepspeed, ...) are not installed, "
                   "instead of stopping.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary of the runs.")
@user_errors
def sweep(matrix: str, budget: str, records_dir: str, device: str | None, dry_run: bool, skip_unavailable: bool,
          as_json: bool) -> None:
    """Measure every setup of MATRIX (YAML), most informative first, within --budget.

    Setups already recorded in --records are skipped; a run that would start after the budget
    is spent is left for the next sweep.
    """
    from ..calibration import sweep as sw

    spec = sw.load_matrix(matrix, device=device)
    runs = sw.order(spec.runs)
    seconds = sw.parse_duration(budget)
    done = sw.recorded_keys(records_dir)
    todo = [r for r in runs if r.key(spec) not in done]
    if dry_run:
        times = {t["name"]: t for t in sw.predicted_schedule(todo, seconds)}
        rows = [{"name": r.name, "key": r.key(spec), "recorded": r.key(spec) in done, "score": r.score,
                 **({k: v for k, v in times[r.name].items() if k != "name"} if r.name in times else {})}
                for r in runs]
        if as_json:
            print_json(rows)
        else:
            where = spec.hardware or "an H200 (no GPU here)"
            click.echo(f"{'':4}  {'run':<40} {'predicted':>9} {'cumulative':>10}   (seconds on {where})")
            for row in rows:
                if row["recorded"]:
                    click.echo(f"skip  {row['name']:<40}")
                    continue
                late = "" if row["within_budget"] else "  past --budget"
                click.echo(f"run   {row['name']:<40} {row['predicted_s']:>9.0f} {row['cumulative_s']:>10.0f}{late}")
            total = max((t["cumulative_s"] for t in times.values()), default=0.0)
            fit = sum(t["within_budget"] for t in times.values())
            click.echo(f"predicted: {total:.0f} s for {len(times)} runs; {fit} fit in the --budget of {seconds:.0f} s")
        return
    unavailable = []
    if skip_unavailable:
        unavailable = [r.name for r in todo if _missing_libraries([r.setup])]
        if unavailable:
            warn(f"left out, their libraries are not installed: {', '.join(unavailable)}")
        todo = [r for r in todo if r.name not in unavailable]
    _require_run_extra([r.setup for r in todo])
    recorded = len(runs) - len(todo) - len(unavailable)
    summary = sw.run_sweep(spec, todo, seconds, records_dir, progress=not as_json)
    summary["skipped_recorded"] = recorded
    if skip_unavailable:
        summary["skipped_unavailable"] = unavailable
    if as_json:
        print_json(summary)
    else:
        click.echo(f"{summary['measured']} measured ({summary['oom']} OOM, {summary['failed']} failed), "
                   f"{summary['skipped_recorded']} already recorded, {summary['left']} left for the next sweep "
                   f"in {summary['seconds']:.0f} s")


@click.command()
@click.option("--records", "records_dir", default="calibration/measurements", show_default=True,
              type=click.Path(file_okay=False), help="Directory of the .jsonl records.")
@click.option("--out", "out_path", default="calibration/coefficients.json", show_default=True,
              type=click.Path(dir_okay=False), help="Where the fitted coefficients are written.")
@click.option("--tolerance", type=float, default=0.03, show_default=True,
              help="Flag a component whose correction factor strays from 1 by more than this.")
@click.option("--published/--no-published", "use_published", default=True, show_default=True,
              help="Fit the published real-GPU rows too (calibration/published/records.jsonl).")
@click.option("--ship/--no-ship", default=None,
              help="Also write the shipped copy, profiles/coefficients.json  [default: in a source checkout, "
                   "when --out is the default]")
@click.option("--json", "as_json", is_flag=True, help="Print the coefficients as JSON.")
@user_errors
def calibrate(records_dir: str, out_path: str, tolerance: float, use_published: bool, ship: bool | None,
              as_json: bool) -> None:
    """Fit the device corrections (CUDA context, workspace, allocator slack) from measurements
    and published real-GPU rows; estimate, plan and check apply them."""
    from pathlib import Path

    from ..calibration import calibrate as cal
    from ..calibration.measure import read_records
    from ..calibration.published import RECORDS, load_records

    records = read_records(records_dir)
    published = load_records(RECORDS) if use_published and RECORDS.is_file() else []
    result = cal.fit(records, tolerance=tolerance, published=published)
    path = cal.write(result, out_path)
    shipped = Path("profiles") / "coefficients.json"
    checkout = (Path("profiles") / "gpus.json").is_file()
    if ship or (ship is None and Path(out_path) == cal.COEFFICIENTS_PATH and checkout):
        cal.write(result, shipped)
        if not as_json:
            click.echo(f"shipped copy written to {shipped}")
    if as_json:
        print_json(result)
        return
    for line in cal.summary_lines(result):
        click.echo(line)
    for flag in result["flags"]:
        warn(flag)
    click.echo(f"written to {path}")
