"""Pictures of a plan: the card's memory split by component, and the memory/speed trade-off.

``memory_segments`` is the one place that decides what the bar shows (shared by the terminal bar
and the HTML page). ``terminal_bar`` renders it with rich; ``html_report`` writes one standalone
page (inline CSS and SVG: no script, no network) with the breakdown bar, the Pareto plot of tokens/s
against memory, and the plan's tables. Pure functions: writing the file is ``write_html``.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path

from ..setup.wording import describe
from ..specs import PHASES, Breakdown, Plan
from ..util.fileio import atomic_write_text
from ..util.units import gib

#: Component -> (rich colour, HTML colour). Unknown components share the last entry's grey.
COLORS: dict[str, tuple[str, str]] = {
    "weights": ("blue", "#3b6fd8"),
    "adapters": ("cyan", "#1fa3b8"),
    "trained_modules": ("cyan", "#1fa3b8"),  # modules_to_save copies, DoRA magnitudes
    "autocast_weight_cache": ("bright_blue", "#7fa4ea"),
    "gradients": ("magenta", "#b548c6"),
    "optimizer_states": ("red", "#d8453b"),
    "optimizer_step": ("bright_red", "#ef8a83"),
    "activations": ("green", "#3a9a4a"),
    "checkpointed_inputs": ("green", "#3a9a4a"),
    "recompute": ("bright_green", "#86c98f"),
    "dora_weight_norm": ("bright_green", "#86c98f"),
    "dequantized_weights": ("bright_cyan", "#6fd0dc"),
    "dequantization": ("bright_cyan", "#6fd0dc"),
    "model_io_activations": ("yellow", "#d8a93b"),
    "logits_loss": ("bright_yellow", "#eccf78"),
    "deepspeed_buffers": ("bright_magenta", "#d79be0"),
    "ddp_buckets": ("bright_magenta", "#d79be0"),
    "fsdp_gathered": ("bright_blue", "#7fa7e0"),
    "other": ("white", "#9a9a9a"),
}
_OTHER = COLORS["other"]


@dataclass(frozen=True)
class Segment:
    name: str
    bytes: int
    terminal_color: str
    html_color: str


def memory_segments(bd: Breakdown) -> list[Segment]:
    """The GPU components live in the peak phase, adding up to ``device_total_bytes``.

    The estimator's phase peak is a maximum over moments, so the live terms can add up to more
    (transients that never coexist) or less than it; the bar shows the total the fit is judged
    on: terms live in every phase at their size, the phase-bound terms sharing what is left in
    proportion. CUDA context, workspaces and allocator slack become "overhead".
    """
    live = [c for c in bd.components if c.where == "gpu" and bd.phase in c.phases and c.bytes > 0]
    overhead_names = {"cuda_context", "cublas_workspace", "allocator_overhead", "nccl"}
    named: dict[str, int] = {}
    for c in live:
        key = "overhead" if c.name in overhead_names or c.name.startswith(("cuda", "nccl")) else c.name
        named[key] = named.get(key, 0) + c.bytes
    total = sum(named.values())
    target = bd.device_total_bytes
    if total > target > 0:
        # Terms live in every phase (weights, adapters, optimizer states, overheads) are in the
        # peak at their full size; only the phase-bound ones (gradients, activations, transients,
        # which peak at different moments) are shrunk to what the peak leaves them.
        always = {c.name for c in live if set(c.phases) >= set(PHASES)} | {"overhead"}
        fixed = sum(v for k, v in named.items() if k in always)
        rest = total - fixed
        room = max(target - fixed, 0)
        named = {k: (v if k in always or not rest else int(v * room / rest)) for k, v in named.items()}
    elif total < target:
        named["other"] = named.get("other", 0) + target - total
    out = []
    for name, n in named.items():
        tc, hc = COLORS.get(name, _OTHER)
        out.append(Segment(name, n, tc, hc))
    return out


# ----------------------------------------------------------------------------------------------
# terminal


def terminal_bar(bd: Breakdown, width: int = 60):
    """A rich Text: the card's usable memory as ``width`` cells, coloured by component, headroom
    dotted; when the step does not fit, the bar spans the need and marks the limit with ``|``."""
    from rich.text import Text

    usable = bd.gpu.usable_memory_bytes if bd.gpu is not None else bd.device_total_bytes
    scale = max(usable, bd.device_total_bytes)
    cells_per_byte = width / scale if scale else 0.0
    limit_cell = round(usable * cells_per_byte)
    text = Text()
    used = 0
    for seg in memory_segments(bd):
        n = round((used + seg.bytes) * cells_per_byte) - round(used * cells_per_byte)
        used += seg.bytes
        text.append("█" * n, style=seg.terminal_color)
    filled = round(used * cells_per_byte)
    if filled < width:
        text.append("·" * (width - filled), style="dim")
    if bd.device_total_bytes > usable and 0 < limit_cell < width:
        text = text[:limit_cell] + Text("|", style="bold red") + text[limit_cell:]
    return text


def terminal_legend(bd: Breakdown, width: int = 80):
    """A rich Text naming each segment with its GiB, wrapped between entries (never inside one)."""
    from rich.text import Text

    text = Text()
    col = 0
    for seg in memory_segments(bd):
        entry = f"{seg.name} {gib(seg.bytes, 1)}"
        if col and col + len(entry) + 2 > width:
            text.append("\n")
            col = 0
        elif col:
            text.append("  ")
            col += 2
        text.append("■ ", style=seg.terminal_color)
        text.append(entry)
        col += len(entry) + 2
    return text


# ----------------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:60rem;color:#222;padding:0 1rem}
h1{font-size:1.4rem;margin-bottom:.2rem}h2{font-size:1.1rem;margin-top:2rem}
.verdict{font-weight:600}.fits{color:#2d7d3a}.nofit{color:#c0392b}.tight{color:#b7791f}
table{border-collapse:collapse;width:100%;font-size:.9rem}td,th{border-bottom:1px solid #ddd;padding:.3rem .5rem;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.legend span{display:inline-block;margin-right:1rem;font-size:.85rem}.sw{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:-.1rem}
svg text{font-family:inherit;font-size:12px;fill:#333}.muted{color:#666;font-size:.85rem}
"""  # noqa: E501 (CSS rules, one a line)


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


#: the page style and the escape the whole-run page shares (plans/fleet_report.py)
CSS = _CSS
escape = _e


def breakdown_svg(bd: Breakdown, width: int = 880, height: int = 56) -> str:
    """A horizontal stacked bar of the card: one rect per component, a line at the usable limit."""
    usable = bd.gpu.usable_memory_bytes if bd.gpu is not None else bd.device_total_bytes
    scale = max(usable, bd.device_total_bytes) or 1
    bar_w = width - 20
    x = 10.0
    parts = [(f'<svg id="breakdown" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 24}" '
              f'viewBox="0 0 {width} {height + 24}" role="img" aria-label="GPU memory by component">')]
    parts.append(f'<rect x="10" y="4" width="{bar_w}" height="{height}" fill="#f1f1f1" stroke="#bbb"/>')
    for seg in memory_segments(bd):
        w = seg.bytes / scale * bar_w
        parts.append(f'<rect class="segment" x="{x:.2f}" y="4" width="{w:.2f}" height="{height}" '
                     f'fill="{seg.html_color}">'
                     f'<title>{_e(seg.name)}: {gib(seg.bytes, 1)} GiB</title></rect>')
        x += w
    lx = 10 + usable / scale * bar_w
    parts.append(f'<line x1="{lx:.2f}" y1="0" x2="{lx:.2f}" y2="{height + 8}" stroke="#c0392b" stroke-width="2" '
                 'stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{min(lx, width - 150):.2f}" y="{height + 22}">usable {gib(usable, 1)} GiB</text>')
    parts.append(f'<text x="10" y="{height + 22}">0</text>')
    parts.append("</svg>")
    return "".join(parts)


def pareto_svg(plan: Plan, width: int = 880, height: int = 360) -> str:
    """Tokens/s against device memory for the chosen plan and its alternatives, with the limit."""
    pts = [("chosen", plan.breakdown.device_total_bytes, plan.tokens_per_s or 0.0, _quality(plan))]
    pts += [(a.quality, a.device_total_bytes, a.tokens_per_s or 0.0, a.quality) for a in plan.alternatives]
    usable = plan.gpu.usable_memory_bytes if plan.gpu is not None else max(p[1] for p in pts)
    max_x = max([usable] + [p[1] for p in pts]) * 1.05
    max_y = max([p[2] for p in pts] + [1.0]) * 1.1
    left, right, top, bottom = 70, 20, 16, 44
    pw, ph = width - left - right, height - top - bottom

    def sx(b: float) -> float:
        return left + b / max_x * pw

    def sy(t: float) -> float:
        return top + ph - t / max_y * ph

    out = [(f'<svg id="pareto" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="tokens per second against memory">')]
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for i in range(6):
        gx = max_x * i / 5
        gy = max_y * i / 5
        out.append(f'<text x="{sx(gx):.1f}" y="{top + ph + 16}" text-anchor="middle">{gib(gx, 1)}</text>')
        out.append(f'<text x="{left - 6}" y="{sy(gy) + 4:.1f}" text-anchor="end">{gy:,.0f}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">device memory (GiB)</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
               'text-anchor="middle">tokens/s</text>')
    ux = sx(usable)
    out.append(f'<line x1="{ux:.1f}" y1="{top}" x2="{ux:.1f}" y2="{top + ph}" stroke="#c0392b" '
               'stroke-dasharray="5 4"/>')
    out.append(f'<text x="{ux - 4:.1f}" y="{top + 12}" text-anchor="end" fill="#c0392b">usable</text>')
    # points are numbered as the alternatives table; only the chosen one is named on the plot
    for i, (label, mem, tps, quality) in reversed(list(enumerate(pts))):
        chosen = label == "chosen"
        fill = "#2d7d3a" if chosen else "#3b6fd8"
        x, y = sx(mem), sy(tps)
        out.append(f'<circle class="point{" chosen" if chosen else ""}" cx="{x:.1f}" cy="{y:.1f}" '
                   f'r="{7 if chosen else 5}" fill="{fill}" fill-opacity="0.85">'
                   f'<title>{_e(quality)}: {gib(mem, 1)} GiB, {tps:,.0f} tokens/s</title></circle>')
        text = f"{_e(quality)} (chosen)" if chosen else str(i)
        anchor = "end" if x > left + pw * 0.75 else "start"
        dx = -10 if anchor == "end" else 8
        dy = 20 if chosen else -7
        weight = ' font-weight="bold"' if chosen else ""
        out.append(f'<text x="{x + dx:.1f}" y="{y + dy:.1f}" text-anchor="{anchor}"{weight}>{text}</text>')
    out.append("</svg>")
    return "".join(out)


def _quality(plan: Plan) -> str:
    from ..search import quality_label

    return quality_label(plan.setup)


def html_report(plan: Plan, title: str | None = None) -> str:
    """One standalone HTML page describing ``plan`` (no script, no external resource)."""
    bd = plan.breakdown
    gpu = plan.gpu
    tight = plan.tight
    if plan.fits:
        verdict = ("tight" if tight else "fits", "tight" if tight else "fits")
    else:
        verdict = ("does not fit", "nofit")
    head = title or f"{plan.model} on {gpu.display_name if gpu else 'no GPU'}"
    rows = []
    rows.append(f"<tr><th>setup</th><td>{_e(describe(plan.setup))}</td></tr>")
    if gpu is not None:
        rows.append(f"<tr><th>memory</th><td>{gib(bd.device_total_bytes, 1)} GiB of "
                    f"{gib(gpu.usable_memory_bytes, 1)} GiB usable"
                    f" ({gib(gpu.usable_memory_bytes - bd.device_total_bytes, 1)} GiB headroom)</td></tr>")
    if plan.tokens_per_s:
        rows.append(f"<tr><th>speed</th><td>~{plan.tokens_per_s:,.0f} tokens/s, {plan.step_time_s or 0:.2f} s per step "
                    f"(global batch {plan.global_batch})</td></tr>")
    if bd.host_bytes:
        rows.append(f"<tr><th>host RAM</th><td>{gib(bd.host_bytes, 1)} GiB per GPU (offloaded state, pinned buffers)"
                    "</td></tr>")
    if nvme := bd.component("nvme_offload"):
        rows.append(f"<tr><th>NVMe</th><td>{gib(nvme, 1)} GiB per GPU (swapped state)</td></tr>")
    if plan.host_ram_bytes:
        rows.append(f"<tr><th>host RAM checked</th><td>{gib(plan.host_ram_bytes, 1)} GiB per node "
                    f"({_e(plan.host_ram_source or 'given')})</td></tr>")
    legend = "".join(f'<span><i class="sw" style="background:{s.html_color}"></i>'
                     f'{_e(s.name)} {gib(s.bytes, 1)} GiB</span>'
                     for s in memory_segments(bd))
    alt_rows = "".join(
        f"<tr><td class='num'>{i}</td><td>{_e(a.quality)}</td><td>{_e(describe(a.setup))}</td>"
        f"<td class='num'>{gib(a.device_total_bytes, 1)}</td>"
        f"<td class='num'>{(a.tokens_per_s or 0):,.0f}</td><td>{_e(a.note)}</td></tr>"
        for i, a in enumerate(plan.alternatives, start=1))
    rej_rows = "".join(f"<tr><td>{_e(r.reason)}</td></tr>" for r in plan.rejected)
    notes = "".join(f"<li>{_e(n)}</li>" for n in plan.notes)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_e(head)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(head)}</h1><p class='verdict {verdict[1]}'>{_e(verdict[0])}</p>",
        f"<table>{''.join(rows)}</table>",
        "<h2>GPU memory at the peak</h2>", breakdown_svg(bd), f"<p class='legend'>{legend}</p>",
    ]
    if plan.fits:
        parts += ["<h2>Memory against speed</h2>", pareto_svg(plan)]
    if plan.alternatives:
        parts.append("<h2>Alternatives (Pareto front)</h2><table><tr><th>#</th><th>quality</th><th>setup</th>"
                     "<th>GiB</th>"
                     f"<th>tokens/s</th><th>vs chosen</th></tr>{alt_rows}</table>")
    if plan.rejected:
        parts.append(f"<h2>Why not</h2><table>{rej_rows}</table>")
    if notes:
        parts.append(f"<h2>Notes</h2><ul>{notes}</ul>")
    parts.append("<p class='muted'>vramplan plan · memory: analytic estimate · speed: first-order cost model</p>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html(plan: Plan, path: str | os.PathLike) -> Path:
    """Write the report atomically (temp file, fsync, rename)."""
    return atomic_write_text(path, html_report(plan))
