"""Memory regression checks for CI: the logic behind ``vramplan check`` and the pytest plugin.

A *check* is one model, one setup and one GPU budget, read from a checks file or a plan file::

    # checks.yaml
    defaults: {gpu: rtx-4090, setup: {checkpointing: true}}   # optional, merged into every check
    checks:
      - name: sft-8b
        model: llama-3.1-8b
        gpu: rtx-4090            # or gpu_memory: 24GiB
        setup: {method: lora, lora_rank: 16, seq: 2048, batch: 1}
        must_fit: true           # default true: fail when device_total_bytes > the GPU's usable memory
        tolerance: 2%            # optional; growth beyond it against the baseline fails

A plan file (``vramplan_plan: 1``, see :mod:`vramplan.plans.planfile`) is one check named after the file,
``must_fit: true``. Each check is estimated (or traced), judged against its GPU, and compared with
the *baseline* (``vram-baseline.json``): the four headline numbers and every component's bytes as
last recorded, with the versions they were recorded under (vramplan, its estimator's
``MODEL_VERSION``, torch, transformers, peft), so a run under other versions says so.

The stages, one module each:

- :mod:`~vramplan.budget.checkfile`: checks files and plan files -> :class:`CheckSpec`;
- :mod:`~vramplan.budget.baseline`: :class:`Record`, the baseline file read and written atomically;
- :mod:`~vramplan.budget.compare`: one check judged -> :class:`CheckResult`;
- :mod:`~vramplan.budget.runner`: every check measured and judged -> :class:`CheckRun`;
- :mod:`~vramplan.budget.output`: JSON, GitHub annotations, the Markdown summary.

Everything here is pure (no printing, no torch on the analytic tier); ``vramplan/commands/check.py``
prints, and writes the baseline through :mod:`vramplan.util.fileio`.

May import: util, specs, model, setup, estimator, plans, readers; run lazily (``--tier trace``).
"""

from __future__ import annotations

from .baseline import (
    BASELINE_FORMAT,
    HEADLINE,
    Record,
    current_versions,
    dumps_baseline,
    read_baseline,
    write_baseline,
)
from .checkfile import CHECK_KEYS, CheckSpec, load_specs, parse_tolerance
from .compare import DEFAULT_TOLERANCE, STATUSES, CheckResult, Delta, compare, signed_gib, version_drift
from .output import (
    RESULT_FORMAT,
    breakdown_diff_lines,
    github_annotations,
    markdown_summary,
    result_to_json,
    run_to_json,
    update_summary,
)
from .runner import TIERS, CheckRun, measure, run_checks, updated_records

__all__ = [
    "BASELINE_FORMAT",
    "CHECK_KEYS",
    "DEFAULT_TOLERANCE",
    "HEADLINE",
    "RESULT_FORMAT",
    "STATUSES",
    "TIERS",
    "CheckResult",
    "CheckRun",
    "CheckSpec",
    "Delta",
    "Record",
    "breakdown_diff_lines",
    "compare",
    "current_versions",
    "dumps_baseline",
    "github_annotations",
    "load_specs",
    "markdown_summary",
    "measure",
    "parse_tolerance",
    "read_baseline",
    "result_to_json",
    "run_checks",
    "run_to_json",
    "signed_gib",
    "update_summary",
    "updated_records",
    "version_drift",
    "write_baseline",
]
