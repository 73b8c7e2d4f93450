"""Reliability fixes (issue 17, lane C), each pinned by a test that failed before it:

- ``--offload-params nvme`` (or cpu) without ``--zero 3``: one line saying what to add (DeepSpeed
  0.19.8's ``offload_param`` is valid only with ZeRO stage 3; FSDP's CPU offload is cpu only);
- the estimate's calibration line says why no calibration applies (no fit for the GPU's class,
  which classes the file fits; no --gpu; --no-calibration) where it said only "none";
- a TRL config's ``model_init_kwargs.device_map`` alone (auto/balanced/sequential) is the layer
  split (``--device-map``), where before it was dropped without a word.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan import load_gpu
from vramplan.cli import main as cli
from vramplan.estimator.corrections import read_coefficients, shipped_coefficients, uncalibrated_reason

# ----------------------------------------------------------------------------------------------
# parameter offload without ZeRO-3


@pytest.mark.parametrize(("flags", "fragments"), [
    (["--offload-params", "nvme"], ["--offload-params nvme needs ZeRO stage 3: add --zero 3",
                                    "FSDP's CPU offload is cpu only"]),
    (["--offload-params", "nvme", "--zero", "2"], ["add --zero 3", "offload_param is valid only with stage 3"]),
    (["--offload-params", "cpu"], ["--offload-params cpu needs ZeRO stage 3: add --zero 3",
                                   "or --fsdp full_shard for FSDP's CPU offload"]),
])
def test_param_offload_without_zero3_says_what_to_add(flags, fragments):
    out = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", *flags, "--gpu", "rtx-4090"])
    line = assert_user_error(out, *fragments)
    assert "or FSDP (--fsdp)" not in line  # before: FSDP named for NVMe, which it cannot offload to


# ----------------------------------------------------------------------------------------------
# the calibration line


@pytest.fixture()
def sm80_only(tmp_path):
    """A coefficients file fitted for sm80 alone (the committed one, whatever a refit adds)."""
    data = read_coefficients(shipped_coefficients())
    data = {**data, "groups": {k: v for k, v in data["groups"].items() if k.startswith("sm80/")}}
    assert data["groups"]
    path = tmp_path / "coefficients.json"
    path.write_text(json.dumps(data))
    return str(path)


def _calibration_line(*args: str) -> str:
    out = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", "--zero", "3", "--offload-params", "nvme",
                                   "--gpus", "2", *args])
    assert out.exit_code == 0, out.output
    text = " ".join(out.stdout.split())  # rich wraps at spaces
    return text[text.index("calibration: "):].split(" does not fit ")[0].split(" fits on ")[0]


def test_no_fit_for_the_gpus_class_is_said(sm80_only):
    line = _calibration_line("--gpu", "rtx-4090", "--calibration", sm80_only)
    assert line.startswith(f"calibration: none (no fit for NVIDIA GeForce RTX 4090's class sm89; {sm80_only} "
                           "fits sm80, and a fit is not carried to another class: published device terms"), line
    assert "device total band -5%/+5% (default" in line


def test_a_fitted_class_names_its_group_and_band(sm80_only):
    line = _calibration_line("--gpu", "a100-80gb", "--calibration", sm80_only)
    assert line.startswith("calibration: sm80/") and "device total band" in line and "default ±5%" not in line


def test_no_gpu_and_no_calibration_say_so():
    assert _calibration_line().startswith("calibration: none (no --gpu: coefficients are fitted per GPU class: ")
    assert _calibration_line("--gpu", "a100-80gb", "--no-calibration").startswith(
        "calibration: none (--no-calibration: published device terms")


def test_uncalibrated_reason_of_a_gpu_without_a_class(sm80_only):
    from vramplan.setup.inputs import resolve_gpu

    why = uncalibrated_reason(resolve_gpu(None, "24GiB"), sm80_only)
    assert why == f"custom GPU (24.0 GiB) has no GPU class (compute capability) to pick a fit by; {sm80_only} fits sm80"
    assert "sm89" in uncalibrated_reason(load_gpu("rtx-4090"), sm80_only)


# ----------------------------------------------------------------------------------------------
# TRL: model_init_kwargs.device_map alone


def _trl(tmp_path, kwargs: dict, extra: str = ""):
    from vramplan.readers import read_config

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\nuse_peft: true\ndtype: bfloat16\n"
                    f"model_init_kwargs: {json.dumps(kwargs)}\n{extra}")
    read = read_config(path)
    return read, {w.field: w for w in read.warnings}


@pytest.mark.parametrize("strategy", ["auto", "balanced", "sequential"])
def test_trl_device_map_alone_is_the_layer_split(tmp_path, strategy):
    read, warned = _trl(tmp_path, {"device_map": strategy})
    assert (read.setup.device_map, read.setup.max_memory, read.setup.gpus) == (strategy, (), 2)
    w = warned["model_init_kwargs.device_map"]
    assert w.kind == "assumed" and "2 GPUs assumed (pass --gpus N)" in w.why


def test_trl_device_map_not_a_split_or_distributed_is_said(tmp_path):
    read, warned = _trl(tmp_path, {"device_map": "cuda:0"})
    assert read.setup.device_map == "none" and "not a layer split" in warned["model_init_kwargs.device_map"].why
    read, warned = _trl(tmp_path, {"device_map": "auto"}, "num_processes: 2\n")
    assert read.setup.device_map == "none" and read.setup.gpus == 2
    assert "device_map=None when distributed" in warned["model_init_kwargs.device_map"].why


def test_trl_device_map_alone_estimates_per_gpu(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text('model_name_or_path: meta-llama/Llama-3.1-8B\nuse_peft: true\ndtype: bfloat16\n'
                    'model_init_kwargs: {"device_map": "auto"}\n')
    out = CliRunner().invoke(cli, ["estimate", str(path), "--gpu", "rtx-3090", "--gpus", "3", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["setup"]["device_map"] == "auto" and len(data["per_rank"]) == 3
