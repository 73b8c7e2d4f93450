"""Import hygiene: the analytic paths never import torch, and the public API is what __all__ says.

Each check runs in a fresh interpreter, since this test process has imported torch elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate")


def run_python(code: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--json"],
        ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090"],
        ["estimate", "qwen3-30b-a3b", "--method", "qlora", "--checkpointing", "--gpu-memory", "24GiB"],
        ["models", "--json"],
        ["gpus"],
    ],
    ids=lambda a: " ".join(a),
)
def test_cli_paths_do_not_import_torch(args):
    run_python(
        f"""
        import sys
        from click.testing import CliRunner
        from vramplan.cli import main
        result = CliRunner().invoke(main, {args!r})
        assert result.exit_code == 0, result.output
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        """
    )


def test_import_vramplan_does_not_import_torch():
    run_python(
        f"""
        import sys
        import vramplan
        for name in vramplan.__all__:
            if name != "trace":
                getattr(vramplan, name)
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        """
    )


def test_all_names_exist():
    import vramplan

    assert vramplan.__all__, "vramplan.__all__ is empty"
    for name in vramplan.__all__:
        assert hasattr(vramplan, name), name
    for name in ("estimate", "trace", "load_model", "load_gpu", "Setup", "ModelSpec", "GpuSpec", "Breakdown",
                 "SpecError", "__version__"):
        assert name in vramplan.__all__, name


def test_public_api_round_trip():
    run_python(
        """
        from vramplan import estimate, load_gpu, load_model, Setup
        bd = estimate(load_model("llama-3.1-8b"), Setup(method="lora", checkpointing=True), load_gpu("rtx-4090"))
        assert bd.fits in (True, False) and bd.device_total_bytes > 0
        """
    )
