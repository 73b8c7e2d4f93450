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
        ["plan", "llama-3.1-8b", "--gpu", "rtx-4090"],
        ["plan", "llama-3.1-70b", "--gpu-memory", "12GiB", "--json"],
        ["estimate", "tests/data/configs/torchtune/llama3_2_1B_lora_single_device.yaml", "--gpu", "rtx-4090"],
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


#: Third-party top-level packages each torch-free command may load (an allow-list, as click's own
#: tests/test_imports.py keeps): anything else creeping onto these paths (numpy, yaml, jsonschema,
#: torch...) fails here. Packages already loaded when the interpreter starts (site hooks) are not counted.
ALLOWED = {
    ("estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--json"): {"click"},
    ("estimate", "llama-3.1-8b", "--gpu", "rtx-4090"): {"click", "rich"},
    ("estimate", "qwen3-30b-a3b", "--method", "qlora", "--checkpointing", "--json"): {"click"},
    ("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--json"): {"click"},
    ("plan", "llama-3.1-8b", "--gpu", "rtx-4090"): {"click", "rich"},
    ("models", "--json"): {"click"},
    ("gpus", "--json"): {"click"},
    # a training config (vramplan.readers): YAML needs yaml (cython_runtime: the module its C
    # loader's Cython extension registers), and nothing else
    ("estimate", "tests/data/configs/axolotl/lora-1b.yml", "--model", "llama-3.2-1b", "--json"):
        {"click", "yaml", "cython_runtime"},
    ("estimate", "tests/data/configs/llamafactory/qwen3_full_sft.yaml", "--model", "qwen3-4b", "--json"):
        {"click", "yaml", "cython_runtime"},
}


@pytest.mark.parametrize("args", sorted(ALLOWED), ids=lambda a: " ".join(a))
def test_cli_paths_import_only_the_allow_list(args):
    out = run_python(
        f"""
        import sys
        def third_party():
            return {{m.split(".")[0] for m in sys.modules}} - set(sys.stdlib_module_names)
        before = third_party()
        from click.testing import CliRunner
        from vramplan.cli import main
        result = CliRunner().invoke(main, {list(args)!r})
        assert result.exit_code == 0, result.output
        print(sorted(m for m in third_party() - before if not m.startswith("_") and m != "vramplan"))
        """
    )
    loaded = set(eval(out.stdout.strip().splitlines()[-1]))
    assert loaded <= ALLOWED[args] | {"click"}, f"not on the allow-list: {sorted(loaded - ALLOWED[args])}"
    assert "click" in loaded  # the snapshot is taken before the CLI loads: the diff sees real imports


def test_check_command_and_pytest_plugin_do_not_import_torch(tmp_path):
    spec = tmp_path / "checks.yaml"
    spec.write_text("checks:\n  - {name: a, model: llama-3.1-8b, gpu: rtx-4090, "
                    "setup: {method: qlora, checkpointing: true}}\n")
    baseline = tmp_path / "vram-baseline.json"
    run_python(
        f"""
        import sys
        from click.testing import CliRunner
        from vramplan.cli import main
        for extra in (["--update"], ["--json"], ["--format", "github", "--summary", ""]):
            result = CliRunner().invoke(main, ["check", {str(spec)!r}, "--baseline", {str(baseline)!r}, *extra])
            assert result.exit_code == 0, result.output
        from vramplan.pytest_plugin import Vram
        assert Vram().estimate("llama-3.1-8b", method="lora", checkpointing=True, gpu="rtx-4090").fits
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        """
    )


def test_emit_does_not_import_torch(tmp_path):
    """`vramplan emit` writes DeepSpeed/Accelerate configs and train.py without importing them."""
    run_python(
        f"""
        import sys
        from click.testing import CliRunner
        from vramplan import Setup, estimate, load_gpu, load_model
        from vramplan.cli import main
        from vramplan.plans.planfile import save_plan
        from vramplan.specs import Plan
        model, gpu = load_model("llama-3.1-8b"), load_gpu("a100-80gb")
        setup = Setup(method="qlora", zero_stage=3, gpus=16, checkpointing=True)
        plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu, nodes=2)
        path = save_plan(plan, {str(tmp_path / "plan.yaml")!r})
        result = CliRunner().invoke(main, ["emit", str(path), "--out", {str(tmp_path / "out")!r}])
        assert result.exit_code == 0, result.output
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        """
    )
    assert (tmp_path / "out" / "ds_config.json").is_file() and (tmp_path / "out" / "train.py").is_file()


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


def test_measure_launcher_sweep_and_calibrate_do_not_import_torch(tmp_path):
    """Only the worker process imports torch: the parent of `measure`, `sweep` and `calibrate` never does."""
    from pathlib import Path

    matrix = Path(__file__).parents[1] / "calibration" / "gpu-sweep.yaml"
    run_python(
        f"""
        import sys
        from click.testing import CliRunner
        from vramplan.cli import main
        import vramplan.calibration.calibrate, vramplan.calibration.measure, vramplan.calibration.sweep
        import vramplan.run.launch
        for args, code in ((["calibrate", "--records", {str(tmp_path)!r}, "--out", {str(tmp_path / "c.json")!r}], 0),
                           (["sweep", {str(matrix)!r}, "--dry-run", "--records", {str(tmp_path)!r}], 0),
                           (["measure", "llama-3.2-1b", "--steps", "0"], 2)):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == code, result.output
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        """
    )
