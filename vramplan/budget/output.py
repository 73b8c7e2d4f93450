"""Machine-readable and CI output of a :class:`~vramplan.budget.runner.CheckRun`: ``check --json``,
GitHub Actions annotations, the Markdown step summary, and the plain-text diff table of the
pytest plugin. Strings only: the CLI prints them."""

from __future__ import annotations

from ..util.units import fmt_bytes
from .baseline import HEADLINE
from .compare import CheckResult, signed_gib
from .runner import CheckRun

RESULT_FORMAT = 1


def result_to_json(r: CheckResult, failed: bool) -> dict:
    """One check in ``check --json``; ``failed`` as the run judged it (``--update`` accepts growth,
    ``--require-baseline`` fails new checks)."""
    bd = r.breakdown
    return {
        "name": r.spec.name,
        "source": r.spec.source,
        "line": r.spec.line,
        "model": bd.model,
        "gpu": r.spec.gpu.name if r.spec.gpu else None,
        "gpu_usable_bytes": r.spec.gpu.usable_memory_bytes if r.spec.gpu else None,
        "must_fit": r.spec.must_fit,
        "fits": bd.fits,
        "headroom_bytes": bd.headroom_bytes,
        "tier": bd.tier,
        "status": r.status,
        "failed": failed,
        "tolerance": r.tolerance,
        "setup": r.spec.setup.to_dict(),
        **{k: getattr(bd, k) for k in HEADLINE},
        "components": dict(r.record.components),
        "baseline": None if r.baseline is None else {**r.baseline.numbers, "components": dict(r.baseline.components),
                                                     "recorded_with": dict(r.baseline.recorded_with)},
        "diff": {"numbers": [d.to_json() for d in r.numbers], "components": [d.to_json() for d in r.components]},
        "reasons": list(r.reasons),
        "notes": list(r.notes),
        "warnings": list(r.warnings),
        "drift": list(r.drift),
    }


def run_to_json(run: CheckRun, *, updated: bool = False) -> dict:
    """What ``vramplan check --json`` prints (docs/schema/check-result.schema.json)."""
    code = run.exit_code(accept_growth=updated)
    failed = {id(r) for r in run.failures(accept_growth=updated)}
    return {
        "vramplan_check": RESULT_FORMAT,
        "ok": code == 0,
        "exit_code": code,
        "tier": run.tier,
        "tolerance": run.tolerance,
        "baseline": {"path": run.baseline_path, "found": run.baseline_found, "updated": updated},
        "versions": dict(run.versions),
        "counts": run.counts(),
        "drift": list(run.drift),
        "stale": list(run.stale),
        "results": [result_to_json(r, id(r) in failed) for r in run.results],
    }


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(run: CheckRun, *, updated: bool = False) -> list[str]:
    """GitHub Actions workflow commands: ``::error`` per failed check, ``::warning`` per shrunk
    or new check and for version drift; each points at the check's file and line."""
    failed = {id(r) for r in run.failures(accept_growth=updated)}
    lines = []
    for r in run.results:
        props = []
        if r.spec.source:
            props.append(f"file={_escape_property(r.spec.source)}")
            if r.spec.line:
                props.append(f"line={r.spec.line}")
        props.append(f"title={_escape_property('vramplan check ' + r.spec.name)}")
        if id(r) in failed:
            why = "; ".join(r.reasons) or "new check without a baseline entry (--require-baseline)"
            lines.append(f"::error {','.join(props)}::{_escape_data(f'{r.spec.name}: {why}')}")
        elif r.status in ("shrank", "new"):
            lines.append(f"::warning {','.join(props)}::{_escape_data(f'{r.spec.name}: ' + '; '.join(r.notes))}")
    for line in run.drift:
        lines.append("::warning title=vramplan baseline versions::"
                     f"{_escape_data('baseline recorded under other versions: ' + line)}")
    return lines


def _md(text: object) -> str:
    """A value for one Markdown table cell or list line: one line, pipes and HTML escaped (a
    check name is user text; the step summary renders HTML)."""
    import html

    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|").replace("`", "\\`")


_ICON = {"over-budget": "❌ over budget", "grew": "❌ grew", "shrank": "⚠️ shrank", "new": "🆕 new", "ok": "✅ ok"}


def markdown_summary(run: CheckRun, *, updated: bool = False) -> str:
    """A Markdown report for ``$GITHUB_STEP_SUMMARY`` (or a PR comment)."""
    failures = run.failures(accept_growth=updated)
    head = (f"{len(failures)} of {len(run.results)} checks failed" if failures
            else f"all {len(run.results)} checks passed")
    where = f"`{_md(run.baseline_path)}`{'' if run.baseline_found else ' (not found)'}{' (updated)' if updated else ''}"
    modelled = run.versions.get("modelled_transformers")  # check --transformers
    stack = f" · models transformers {_md(modelled)}" if modelled else ""
    out = [f"### vramplan check: {head}", "",
           f"{run.tier} tier · tolerance {run.tolerance:.1%} · baseline {where}{stack}", "",
           "| check | model | GPU | device total | usable | vs baseline | status |",
           "|---|---|---|---:|---:|---:|---|"]
    for r in run.results:
        bd = r.breakdown
        usable = fmt_bytes(r.spec.gpu.usable_memory_bytes) if r.spec.gpu else "-"
        dt = r.device_total
        vs = f"{dt.relative:+.1%}" if dt is not None and dt.relative is not None else "-"
        out.append(f"| {_md(r.spec.name)} | {_md(bd.model)} | {_md(r.spec.gpu.name) if r.spec.gpu else '-'} | "
                   f"{fmt_bytes(bd.device_total_bytes)} | {usable} | {vs} | {_ICON[r.status]} |")
    for r in run.results:
        if not (r.reasons or r.notes or r.components):
            continue
        out += ["", f"<details><summary>{_md(r.spec.name)}: {_ICON[r.status]}</summary>", ""]
        out += [f"- {_md(line)}" for line in (*r.reasons, *r.notes, *r.warnings)]
        if r.components:
            out += ["", "| component | baseline | now | change |", "|---|---:|---:|---:|"]
            out += [f"| {_md(d.name)} | {fmt_bytes(d.baseline_bytes)} | {fmt_bytes(d.current_bytes)} "
                    f"| {signed_gib(d.delta_bytes)} |"
                    for d in r.components]
        out += ["", "</details>"]
    if run.drift:
        out += ["", "**Baseline recorded under other versions:** " + _md("; ".join(run.drift))]
    if run.stale:
        out += ["", "Baseline entries no check refers to: " + ", ".join(f"`{_md(n)}`" for n in run.stale)]
    return "\n".join(out) + "\n"


def update_summary(run: CheckRun) -> str:
    """What ``check --update`` recorded: how many checks, and how many of them are new, changed
    (a headline number or a component moved) and unchanged."""
    new = sum(1 for r in run.results if r.baseline is None)
    changed = sum(1 for r in run.results if r.baseline is not None
                  and (r.baseline.numbers != r.record.numbers or r.baseline.components != r.record.components))
    return f"{len(run.results)} recorded: {new} new, {changed} changed, {len(run.results) - new - changed} unchanged"


def breakdown_diff_lines(old: dict[str, int], new: dict[str, int], old_label: str = "baseline") -> list[str]:
    """A plain-text table of the numbers that differ between two {name: bytes} mappings (used by
    the pytest plugin's failure messages)."""
    names = list(dict.fromkeys([*old, *new]))
    rows = [(n, old.get(n, 0), new.get(n, 0)) for n in names if old.get(n, 0) != new.get(n, 0)]
    if not rows:
        return []
    width = max(len(n) for n, _, _ in rows)
    lines = [f"{'':<{width}}  {old_label:>12}  {'now':>12}  {'change':>12}"]
    for n, a, b in rows:
        rel = f" ({(b - a) / a:+.1%})" if a else ""
        lines.append(f"{n:<{width}}  {fmt_bytes(a):>12}  {fmt_bytes(b):>12}  {signed_gib(b - a):>12}{rel}")
    return lines
