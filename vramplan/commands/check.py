"""`vramplan check`: fail CI when a change pushes fine-tuning memory past the budget or the baseline.

The checks, the comparison and the machine-readable outputs live in :mod:`vramplan.budget` (pure);
this module prints them and writes the baseline. Exit codes: 0 every check passed, 1 a regression
(a ``must_fit`` check over its GPU's usable memory, or a headline number grown beyond the
tolerance), 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

from pathlib import Path

import click

from ..specs import SpecError
from ..util.units import gib
from .options import (
    calibration_options,
    corrections_for,
    print_json,
    quiet_libraries,
    stack_for,
    transformers_option,
    user_errors,
    warn,
)


@click.command()
@click.argument("specs", nargs=-1, required=True, metavar="SPEC...")
@click.option("--baseline", "baseline_path", default="vram-baseline.json", show_default=True, metavar="PATH",
              help="Recorded numbers to compare with (JSON; written by --update).")
@click.option("--update", is_flag=True,
              help="Record this run's numbers in the baseline (atomically) and print the diff.")
@click.option("--tolerance", default="2%", show_default=True, metavar="PCT",
              help="Growth of a headline number beyond this fails the check (a check's own tolerance wins).")
@click.option("--tier", type=click.Choice(["analytic", "trace"]), default="analytic", show_default=True,
              help="analytic: the estimator (no torch, milliseconds); trace: fake-tensor trace (needs torch).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "github"]), default="table", show_default=True,
              help="github: ::error/::warning annotations and a Markdown summary.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--require-baseline", is_flag=True, help="Fail checks that have no baseline entry.")
@click.option("--summary", "summary_path", envvar="GITHUB_STEP_SUMMARY", metavar="PATH", show_envvar=True,
              help="With --format github: append the Markdown summary to PATH instead of printing it.")
@calibration_options
@transformers_option
@user_errors
def check(specs: tuple[str, ...], baseline_path: str, update: bool, tolerance: str, tier: str, fmt: str,
          as_json: bool, require_baseline: bool, summary_path: str | None, no_calibration: bool,
          calibration_file: str | None, transformers_version: str | None) -> None:
    """Check memory of the training setups in SPEC files against GPU budgets and a baseline.

    SPEC is a checks file (YAML or JSON: `checks: [{name, model, gpu, setup, must_fit, tolerance}]`)
    or a plan file (one check, named after the file). Exit code 0: all passed; 1: a check is over
    its budget or grew beyond the tolerance; 2: bad input. --transformers: the analytic tier
    estimates every check under that version (a plan file made under one keeps it otherwise).
    """
    from ..budget import (
        load_specs,
        parse_tolerance,
        read_baseline,
        run_checks,
        updated_records,
        write_baseline,
    )

    fmt = "json" if as_json else fmt
    tol = parse_tolerance(tolerance, "--tolerance")
    stack = stack_for(transformers_version) if transformers_version is not None else None
    if stack is not None and tier == "trace":
        raise SpecError("--transformers goes with --tier analytic: the trace tier runs the installed transformers")
    checks = load_specs(specs)
    baseline = read_baseline(baseline_path)
    if tier == "trace":
        quiet_libraries()
        for c in checks:  # a checks file's transformers: key, or the version a plan file was planned under
            if c.transformers:
                warn(f"check {c.name!r}: transformers {c.transformers} is what the analytic tier models; "
                     "--tier trace runs the installed transformers")
    applied: dict = {}  # GPU -> Corrections: the loader's warnings print once

    def corrections(gpu):
        key = gpu.name if gpu is not None else None
        if key not in applied:
            applied[key] = corrections_for(gpu, no_calibration, calibration_file)
        return applied[key]

    run = run_checks(checks, baseline, tier=tier, tolerance=tol, baseline_path=baseline_path,
                     require_baseline=require_baseline, corrections=corrections, stack=stack)
    if baseline is None and not update:
        warn(f"no baseline at {baseline_path}: every check is new (vramplan check --update records one)")
    for r in run.results:
        for w in r.warnings:
            warn(f"check {r.spec.name!r}: {w}")
    if update:
        write_baseline(baseline_path, updated_records(baseline, run))
    _report(run, fmt, update, summary_path)
    code = run.exit_code(accept_growth=update)
    if code:
        raise SystemExit(code)


def _report(run, fmt: str, updated: bool, summary_path: str | None) -> None:
    from ..budget import github_annotations, markdown_summary, run_to_json

    if fmt == "json":
        print_json(run_to_json(run, updated=updated))
    elif fmt == "github":
        for line in github_annotations(run, updated=updated):
            click.echo(line)
        text = markdown_summary(run, updated=updated)
        if summary_path:
            _append(summary_path, text)
        else:
            click.echo(text, nl=False)
    else:
        _print_table(run, updated)


def _append(path: str, text: str) -> None:
    """Append to the step summary through an atomic rewrite (other steps append to it too)."""
    from ..util.fileio import atomic_write_text

    try:
        old = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        old = ""
    atomic_write_text(path, old + ("\n" if old and not old.endswith("\n") else "") + text)


_STYLE = {"over-budget": "bold red", "grew": "bold red", "shrank": "yellow", "new": "cyan", "ok": "green"}


def _print_table(run, updated: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..budget import update_summary
    from ..budget.compare import NO_BASELINE_NOTE

    console = Console(highlight=False)
    table = Table(show_edge=False, pad_edge=False)
    for col, justify in (("check", "left"), ("gpu", "left"), ("needs GiB", "right"), ("usable", "right"),
                         ("vs base", "right"), ("status", "left")):
        table.add_column(col, justify=justify, overflow="fold", no_wrap=col != "check")
    for r in run.results:
        bd = r.breakdown
        dt = r.device_total
        table.add_row(
            escape(r.spec.name), escape(r.spec.gpu.name) if r.spec.gpu else "-", gib(bd.device_total_bytes),
            gib(r.spec.gpu.usable_memory_bytes) if r.spec.gpu else "-",
            f"{dt.relative:+.1%}" if dt is not None and dt.relative is not None else "-",
            f"[{_STYLE[r.status]}]{r.status}{' (recorded)' if updated and r.status == 'grew' else ''}[/]",
        )
    console.print(f"[bold]vramplan check[/] · {run.tier} tier · tolerance {run.tolerance:.1%} · "
                  f"baseline {escape(run.baseline_path)}{'' if run.baseline_found else ' (none yet)'}"
                  + (f" · models transformers {escape(modelled)}" if (modelled := run.versions.get(
                      "modelled_transformers")) else ""))
    console.print(table)
    for r in run.results:
        if not (r.reasons or r.components or any(n != NO_BASELINE_NOTE for n in r.notes)):
            continue
        console.print(f"\n[{_STYLE[r.status]}]{escape(r.spec.name)}[/]: {r.status}"
                      f"{' (recorded by --update)' if updated and r.status == 'grew' else ''}")
        for line in (*r.reasons, *r.notes):
            console.print(f"  {escape(line)}")
        if r.numbers or r.components:
            diff = Table(show_edge=False, pad_edge=False, box=None)
            for col in ("", "baseline GiB", "now GiB", "change GiB", "change"):
                diff.add_column(col, justify="left" if not col else "right")
            moved = [d for d in r.numbers if d.delta_bytes] + list(r.components)
            for d in moved:
                rel = f"{d.relative:+.1%}" if d.relative is not None else "new"
                diff.add_row(escape(d.name), gib(d.baseline_bytes), gib(d.current_bytes),
                             f"{'+' if d.delta_bytes >= 0 else '-'}{gib(abs(d.delta_bytes))}", rel)
            if moved:
                console.print(diff)
    if run.drift:
        console.print("\n[yellow]baseline recorded under other versions:[/] " + escape("; ".join(run.drift)))
    if run.stale:
        console.print(f"[dim]baseline entries no check refers to: {escape(', '.join(run.stale))}[/]")
    failures = run.failures(accept_growth=updated)
    counts = ", ".join(f"{n} {s}" for s, n in run.counts().items() if n)
    verdict = f"[bold red]{len(failures)} failed[/]" if failures else "[bold green]passed[/]"
    console.print(f"\n{len(run.results)} checks: {counts} · {verdict}")
    if updated:
        console.print(f"baseline updated: {escape(run.baseline_path)} ({escape(update_summary(run))})")

