"""The whole-run comparison as one standalone HTML page (``plan --gpu any ... --html FILE``): hours against
dollars for every card and count (search/fleet.py), the Pareto front (no other row both cheaper and
faster) joined and marked, the cheapest and the fastest named, and the rows as a table. Inline SVG, no
script, no network; the page is checked in headless chromium (tests/test_fleet.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..search.fleet import Fleet, FleetOption
from ..util.fileio import atomic_write_text
from .report import CSS, escape

__all__ = ["fleet_html", "fleet_svg", "pareto_front", "write_fleet_html"]

_PALETTE = ("#3b6fd8", "#d8703b", "#2d7d3a", "#8e44ad", "#c0392b", "#16a085", "#b7791f", "#555555", "#e84393",
            "#00838f", "#6d4c41", "#7cb342", "#5c6bc0", "#f4511e")


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def _h(x: float) -> str:
    return f"{x:,.1f} h" if x >= 1 else f"{x * 60:,.0f} min" if x * 60 >= 1 else f"{x * 3600:,.0f} s"


def pareto_front(options: tuple[FleetOption, ...]) -> list[int]:
    """Indices of the priced rows no other priced row beats on both hours and dollars, fastest first."""
    priced = [i for i, o in enumerate(options) if o.usd is not None]
    front = [i for i in priced if not any(
        options[j].hours <= options[i].hours and options[j].usd <= options[i].usd
        and (options[j].hours, options[j].usd) != (options[i].hours, options[i].usd) for j in priced)]
    return sorted(front, key=lambda i: options[i].hours)


def fleet_svg(fleet: Fleet, width: int = 880, height: int = 420) -> str:
    """Hours (log scale) against dollars, one point per priced row, coloured by card."""
    rows = [(i, o) for i, o in enumerate(fleet.options) if o.usd is not None]
    left, right, top, bottom = 78, 150, 16, 48
    pw, ph = width - left - right, height - top - bottom
    out = [(f'<svg id="fleet" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="hours against dollars per card and count">')]
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    if not rows:
        out.append(f'<text x="{left + 10}" y="{top + 20}">no priced row</text></svg>')
        return "".join(out)
    hours = [o.hours for _, o in rows]
    lo_h, hi_h = math.log10(max(min(hours), 1e-3)) - 0.1, math.log10(max(hours)) + 0.1
    max_usd = max(o.usd for _, o in rows) * 1.1 or 1.0

    def sx(h: float) -> float:
        return left + (math.log10(max(h, 1e-3)) - lo_h) / (hi_h - lo_h) * pw

    def sy(usd: float) -> float:
        return top + ph - usd / max_usd * ph

    for k in range(int(math.floor(lo_h)), int(math.ceil(hi_h)) + 1):
        for m in (1, 2, 5):
            h = m * 10**k
            if lo_h <= math.log10(h) <= hi_h:
                out.append(f'<line x1="{sx(h):.1f}" y1="{top}" x2="{sx(h):.1f}" y2="{top + ph}" stroke="#eee"/>')
                out.append(f'<text x="{sx(h):.1f}" y="{top + ph + 16}" text-anchor="middle">{h:g}</text>')
    for i in range(6):
        usd = max_usd * i / 5
        out.append(f'<text x="{left - 6}" y="{sy(usd) + 4:.1f}" text-anchor="end">{_usd(usd)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">hours (log scale)</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" '
               'text-anchor="middle">US dollars</text>')
    front = pareto_front(fleet.options)
    if len(front) > 1:
        path = " ".join(f"{'M' if n == 0 else 'L'}{sx(fleet.options[i].hours):.1f},{sy(fleet.options[i].usd):.1f}"
                        for n, i in enumerate(front))
        out.append(f'<path class="front" d="{path}" fill="none" stroke="#2d7d3a" stroke-width="2" '
                   'stroke-dasharray="6 3"/>')
    cards = list(dict.fromkeys(o.gpu for _, o in rows))
    colour = {c: _PALETTE[n % len(_PALETTE)] for n, c in enumerate(cards)}
    for i, o in rows:
        x, y = sx(o.hours), sy(o.usd)
        on_front = i in front
        out.append(f'<circle class="point{" on-front" if on_front else ""}" cx="{x:.1f}" cy="{y:.1f}" '
                   f'r="{6 if on_front else 4}" fill="{colour[o.gpu]}" fill-opacity="0.85" '
                   f'stroke="{"#222" if on_front else "none"}"><title>{escape(o.gpus)} x {escape(o.gpu)}: '
                   f'{_h(o.hours)}, {_usd(o.usd)} ({escape(o.plan_line)})</title></circle>')
        if i in (fleet.cheapest, fleet.fastest):
            what = "cheapest" if i == fleet.cheapest else "fastest"
            if i == fleet.cheapest and i == fleet.fastest:
                what = "cheapest and fastest"
            out.append(f'<text x="{x + 8:.1f}" y="{y - 8:.1f}" font-weight="bold">{what}: {o.gpus} x '
                       f'{escape(o.gpu)}</text>')
    for n, c in enumerate(cards):  # the legend, beside the plot
        y = top + 14 + n * 18
        out.append(f'<circle cx="{left + pw + 16}" cy="{y - 4}" r="5" fill="{colour[c]}"/>'
                   f'<text x="{left + pw + 26}" y="{y}">{escape(c)}</text>')
    out.append("</svg>")
    return "".join(out)


def fleet_html(fleet: Fleet, title: str | None = None) -> str:
    """The page: the plot, the cheapest and the fastest, and every row."""
    title = title or f"vramplan: {fleet.model}, {fleet.dataset_tokens:,} tokens x {fleet.epochs}"
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{escape(fleet.model)}: which GPU, how many, how long, how much</h1>",
             f"<p>{fleet.dataset_tokens:,} tokens x {fleet.epochs} epoch{'s' if fleet.epochs > 1 else ''}; "
             f"rows ranked by {escape(fleet.rank_by)}; prices of {escape(fleet.price_date)}.</p>"]
    if fleet.cheapest is not None:
        c = fleet.options[fleet.cheapest]
        parts.append(f"<p><b>Cheapest</b>: {c.gpus} x {escape(c.gpu)}, {_usd(c.usd)} in {_h(c.hours)} "
                     f"(<span class='muted'>{escape(c.price_source)}</span>)</p>")
    if fleet.fastest is not None:
        f = fleet.options[fleet.fastest]
        money = "" if f.usd is None else f", {_usd(f.usd)}"
        parts.append(f"<p><b>Fastest</b>: {f.gpus} x {escape(f.gpu)}, {_h(f.hours)}{money}</p>")
    parts += ["<h2>Hours against dollars</h2>", fleet_svg(fleet),
              "<p class='muted'>Joined: the Pareto front (no other row both cheaper and faster). Hours from the "
              "cost model's tokens/s, no measured band per card class yet.</p>", "<h2>Every card and count</h2>",
              "<table><tr><th>GPU</th><th>GPUs</th><th>tokens/s</th><th>time</th><th>USD</th><th>$/GPU-h</th>"
              "<th>plan</th></tr>"]
    for o in fleet.options:
        usd = "-" if o.usd is None else f"{o.usd:,.2f}"
        rate = "-" if o.usd_per_gpu_hour is None else f"{o.usd_per_gpu_hour:.3f}"
        parts.append(f"<tr><td>{escape(o.gpu)}</td><td class='num'>{o.gpus}</td><td class='num'>{o.tokens_per_s:,.0f}"
                     f"</td><td class='num'>{_h(o.hours)}</td><td class='num'>{usd}</td><td class='num'>{rate}</td>"
                     f"<td>{escape(o.plan_line)}</td></tr>")
    parts.append("</table>")
    for line in (*fleet.cut, *(f"nothing fits: {x}" for x in fleet.no_fit)):
        parts.append(f"<p class='muted'>{escape(line)}</p>")
    parts.append("<p class='muted'>vramplan plan · memory: analytic estimate · speed: first-order cost model · "
                 "prices: profiles/prices.json (--price NAME=USD, --prices FILE)</p></body></html>\n")
    return "".join(parts)


def write_fleet_html(fleet: Fleet, path: str | os.PathLike) -> Path:
    """Write the page atomically (temp file, fsync, rename)."""
    return atomic_write_text(path, fleet_html(fleet))
