"""The plan's pictures: the memory bar's arithmetic, the standalone HTML, and that a browser renders it.

The browser test loads the page in Debian's headless chromium (installed by .ci/run) with the
network off and checks the SVG charts are in the rendered DOM and the screenshot is not blank.
It is skipped only where no chromium binary exists.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib

import pytest

import vramplan
from vramplan.plans.report import html_report, memory_segments, terminal_bar, write_html
from vramplan.specs import GpuSpec

GiB = 2**30


@pytest.fixture(scope="module")
def fitting():
    return vramplan.plan("llama-3.1-8b", "rtx-4090")


@pytest.fixture(scope="module")
def failing():
    return vramplan.plan("llama-3.1-8b", GpuSpec.custom(3 * GiB), relax=False)


def test_segments_add_up_to_the_device_total(fitting, failing):
    for plan in (fitting, failing):
        segs = memory_segments(plan.breakdown)
        assert abs(sum(s.bytes for s in segs) - plan.breakdown.device_total_bytes) <= len(segs)
        names = [s.name for s in segs]
        assert "weights" in names or "adapters" in names
        assert all(s.bytes > 0 for s in segs)


def test_terminal_bar_spans_the_card(fitting, failing):
    bar = terminal_bar(fitting.breakdown, width=50)
    assert len(bar.plain) == 50
    assert bar.plain.endswith("·")  # headroom
    used = bar.plain.count("█")
    expected = fitting.breakdown.device_total_bytes / fitting.gpu.usable_memory_bytes * 50
    assert abs(used - expected) <= 1
    over = terminal_bar(failing.breakdown, width=50)
    assert "|" in over.plain and "·" not in over.plain  # the limit is marked inside a full bar


def test_html_says_which_host_ram_was_checked(fitting):
    page = html_report(fitting)
    gib = fitting.host_ram_bytes / GiB
    assert f"<th>host RAM checked</th><td>{gib:,.1f} GiB per node ({fitting.host_ram_source})" in page


def test_html_is_standalone(fitting, failing):
    page = html_report(fitting)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert '<svg id="breakdown"' in page and '<svg id="pareto"' in page
    assert page.count('class="segment"') == len(memory_segments(fitting.breakdown))
    assert page.count('<circle class="point') == 1 + len(fitting.alternatives)
    assert "<script" not in page.lower()
    # no resource is fetched: the only URL is the SVG namespace
    assert set(re.findall(r"https?://[^\"' )]+", page)) <= {"http://www.w3.org/2000/svg"}
    assert not re.search(r"\b(src|href)\s*=", page)
    bad = html_report(failing)
    assert "does not fit" in bad and '<svg id="breakdown"' in bad and '<svg id="pareto"' not in bad


def test_html_escapes_text(fitting):
    import dataclasses

    odd = dataclasses.replace(fitting, model="<b>evil</b>", notes=("a < b & c",))
    page = html_report(odd)
    assert "<b>evil</b>" not in page and "&lt;b&gt;evil&lt;/b&gt;" in page and "a &lt; b &amp; c" in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _png_colours(data: bytes) -> int:
    """Distinct colours in an 8-bit RGB(A) non-interlaced PNG (what chromium writes), sampled."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    colours = {row[x:x + 3] for row in rows[::7] for x in range(0, stride, channels * 5)}
    return len(colours)


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_html_renders_in_headless_chromium(fitting, tmp_path):
    page = write_html(fitting, tmp_path / "report.html")
    profile = tempfile.mkdtemp(prefix="vramplan-chromium-")
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}"]
    env = {**os.environ, "HOME": profile}
    try:
        dom = subprocess.run(base + ["--dump-dom", page.resolve().as_uri()], check=False, capture_output=True,
                             text=True, timeout=90, env=env)
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert '<svg id="breakdown"' in dom.stdout and '<svg id="pareto"' in dom.stdout
        assert dom.stdout.count('class="segment"') == len(memory_segments(fitting.breakdown))
        shot = tmp_path / "shot.png"
        png = subprocess.run(base + [f"--screenshot={shot}", "--window-size=1000,900", page.resolve().as_uri()],
                             check=False, capture_output=True, text=True, timeout=90, env=env)
        assert png.returncode == 0 and shot.exists(), png.stderr[-2000:]
        assert _png_colours(shot.read_bytes()) > 8  # bars, points and text: not a blank page
    finally:
        shutil.rmtree(profile, ignore_errors=True)
