"""How long reading a training config takes (vramplan.readers.read_config), per corpus file.

The bar (issue 15): reading a config adds < 50 ms to ``vramplan estimate``. Prints a table:
the first read in a fresh interpreter (imports yaml and the readers) and the median of warm
reads, per file. Run: ``python benchmarks/reader_speed.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "configs"


def cold_ms(path: Path) -> float:
    """The first read in a fresh interpreter, vramplan already imported (what the CLI adds)."""
    code = ("import time, vramplan.specs, vramplan.setup.inputs; t=time.perf_counter(); "
            f"from vramplan.readers import read_config; read_config({str(path)!r}); print((time.perf_counter()-t)*1e3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def warm_ms(path: Path, repeat: int = 20) -> float:
    from vramplan.readers import read_config

    read_config(path)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        read_config(path)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    files = sorted(p for p in CONFIGS.rglob("*") if p.is_file() and p.name != "SOURCES.json")
    print(f"{'config':58} {'cold ms':>8} {'warm ms':>8}")
    worst = 0.0
    for p in files:
        cold, warm = cold_ms(p), warm_ms(p)
        worst = max(worst, cold)
        print(f"{str(p.relative_to(CONFIGS)):58} {cold:8.1f} {warm:8.2f}")
    print(f"worst first read: {worst:.1f} ms (bar: < 50 ms)")


if __name__ == "__main__":
    main()
