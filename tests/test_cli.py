"""The command line, driven through click's CliRunner against the real profiles and estimator.

Every user mistake must end in exit code 2 and exactly one stderr line starting with ``error:``,
never a traceback; warnings go to stderr and leave the exit code at 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.cli import main

HEADLINE = ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes")
JSON_KEYS = HEADLINE + ("fits", "phase", "components", "params_total", "params_trainable")


@pytest.fixture(scope="module", autouse=True)
def hub_offline():
    """A name like ``org/model`` goes to the Hub; with no network that retries for ~20 s. Tests
    run offline, where huggingface_hub answers at once from its (empty) cache."""
    try:
        import huggingface_hub.constants as hub
    except ImportError:  # pragma: no cover - the test extra installs it
        yield
        return
    old = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    yield
    hub.HF_HUB_OFFLINE = old


def run(*args: str):
    return CliRunner().invoke(main, list(args))


# ----------------------------------------------------------------------------------------------
# Happy paths


def test_estimate_table_does_not_fit():
    r = run("estimate", "llama-3.1-8b", "--gpu", "rtx-4090")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    out = r.stdout
    assert "meta-llama/Llama-3.1-8B" in out
    for word in ("component", "peak phase", "tensor peak", "peak allocated", "peak reserved", "device total"):
        assert word in out
    assert "does not fit" in out and "RTX 4090" in out


def test_estimate_lora_checkpointing_fits():
    r = run("estimate", "llama-3.1-8b", "--method", "lora", "--checkpointing", "--gpu-memory", "80GiB")
    assert r.exit_code == 0, r.output
    assert "fits" in r.stdout and "does not fit" not in r.stdout
    assert "lora r=16" in r.stdout and "checkpointing" in r.stdout


def test_estimate_json():
    r = run("estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # exactly one JSON object, nothing else on stdout
    for key in JSON_KEYS:
        assert key in data, key
    assert data["fits"] is False
    assert data["tier"] == "analytic"
    assert data["params_total"] == 8_030_261_248
    assert data["params_trainable"] == data["params_total"]
    assert (data["device_total_bytes"] >= data["peak_reserved_bytes"] >= data["peak_allocated_bytes"]
            >= data["tensor_peak_bytes"] > 0)
    assert data["components"] and all({"name", "bytes", "phases"} <= set(c) for c in data["components"])


def test_estimate_json_setup_options_reach_the_setup():
    r = run(
        "estimate", "smollm2-135m", "--json", "--method", "qlora", "--lora-rank", "8", "--lora-alpha", "4",
        "--lora-dropout", "0.1", "--lora-targets", "q_proj,v_proj", "--no-double-quant", "--precision",
        "bf16", "--optimizer", "adamw-8bit", "--checkpointing", "--attn", "eager", "--batch", "2", "--seq",
        "128", "--grad-accum", "4", "--zero", "2", "--offload-optimizer", "cpu", "--gpus", "2", "--loss",
        "chunked", "--pad-mask",
    )
    assert r.exit_code == 0, r.output
    setup = json.loads(r.stdout)["setup"]
    assert setup == {
        "method": "qlora", "lora_rank": 8, "lora_alpha": 4, "lora_dropout": 0.1, "lora_targets": "q_proj,v_proj",
        "quant": "nf4", "double_quant": False, "quant_bits": 4, "quant_group_size": 128, "precision": "bf16",
        "optimizer": "adamw-8bit",
        "checkpointing": True, "attn": "eager", "batch": 2, "seq": 128, "grad_accum": 4, "zero_stage": 2,
        "offload_optimizer": "cpu", "offload_params": "none", "gpus": 2, "loss": "chunked", "pad_mask": True,
        "fsdp": "none", **NEW_KNOBS_OFF,
    }


#: The Setup fields added after the first ones, all at their defaults (off) in the run above.
NEW_KNOBS_OFF = {
    "checkpoint_every": 1,
    "modules_to_save": "", "dora": False, "activation_offload": False, "liger": False, "optimizer_in_backward": False,
    "padding_free": False, "eval_batch": 0, "device_map": "none", "tp": 1, "cp": 1, "fsdp_version": 1,
    "dp_replicate": 1, "framework": "hf",
    "objective": "sft", "max_prompt_length": 0, "max_completion_length": 0, "num_generations": 8, "ref_model": "auto",
    "generation": "hf", "vllm_memory_fraction": 0.3, "max_memory": [],
}


def test_defaults_are_setup_defaults():
    from vramplan.specs import Setup

    r = run("estimate", "smollm2-135m", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["setup"] == Setup().to_dict()
    assert data["fits"] is None and data["gpu"] is None


def test_estimate_no_gpu_says_how_to_check_fit():
    r = run("estimate", "qwen2-0.5b")
    assert r.exit_code == 0, r.output
    assert "--gpu" in r.stdout


def test_estimate_config_path_and_directory(tmp_path):
    from vramplan.model.profiles import load_model

    cfg = dict(load_model("smollm2-135m").config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for model in (str(tmp_path / "config.json"), str(tmp_path)):
        r = run("estimate", model, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["params_total"] == 134_515_008


def test_seq_above_max_positions_warns_and_succeeds():
    r = run("estimate", "llama-3.1-8b", "--seq", "200000")
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == "warning: seq 200000 exceeds max_position_embeddings 131072 of meta-llama/Llama-3.1-8B"


def test_lora_options_with_full_method_warn():
    r = run("estimate", "smollm2-135m", "--lora-rank", "8", "--json")
    assert r.exit_code == 0
    assert r.stderr.startswith("warning: --lora-rank has no effect with --method full")
    json.loads(r.stdout)


def test_unmatched_lora_target_warns():
    r = run("estimate", "smollm2-135m", "--method", "lora", "--lora-targets", "q_proj,nope", "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("warning: --lora-targets 'nope' matches no Linear")


def test_no_bf16_gpu_warns():
    r = run("estimate", "smollm2-135m", "--gpu", "t4")
    assert r.exit_code == 0, r.output
    assert "has no bf16" in r.stderr


def test_models():
    r = run("models")
    assert r.exit_code == 0, r.output
    assert "meta-llama/Llama-3.1-8B" in r.stdout and "llama-3.1-8b" in r.stdout
    rows = json.loads(run("models", "--json").stdout)
    by_id = {row["hf_id"]: row for row in rows}
    llama = by_id["meta-llama/Llama-3.1-8B"]
    assert llama["model_type"] == "llama" and llama["params_total"] == 8_030_261_248
    assert "llama-3.1-8b" in llama["aliases"]


def test_models_table_fits_the_terminal():
    """The plain table wraps its id and alias columns to the terminal's width (80 when not a terminal) and keeps
    every row's columns aligned; wider terminals get one line a model."""
    narrow = CliRunner().invoke(main, ["models"], env={"COLUMNS": "80"}).stdout.splitlines()
    assert max(len(line) for line in narrow) <= 80
    assert len({line.index("┃") for line in narrow[:1]} | {line.index("│") for line in narrow[2:] if "│" in line}) == 1
    wide = CliRunner().invoke(main, ["models"], env={"COLUMNS": "250"}).stdout.splitlines()
    rows = json.loads(run("models", "--json").stdout)
    assert len(wide) == len(rows) + 3 and any(line.startswith("meta-llama/Llama-3.1-8B ") for line in wide)
    assert wide[-1].startswith(f"{len(rows)} models;")


def test_gpus():
    r = run("gpus")
    assert r.exit_code == 0, r.output
    assert "rtx-4090" in r.stdout and "usable GiB" in r.stdout
    rows = json.loads(run("gpus", "--json").stdout)
    by_name = {row["name"]: row for row in rows}
    assert by_name["rtx-4090"]["usable_memory_bytes"] > 20 * 1024**3
    assert by_name["t4"]["bf16"] is False


def test_trace_tiny_model_json():
    r = run("trace", "smollm2-135m", "--seq", "64", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    for key in JSON_KEYS:
        assert key in data
    assert data["tier"] == "traced" and data["tensor_peak_bytes"] > 0


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "vramplan", "--help"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    for cmd in ("estimate", "trace", "models", "gpus"):
        assert cmd in out.stdout


def test_estimate_help_lists_every_setup_option():
    r = run("estimate", "--help")
    assert r.exit_code == 0
    for flag in ("--method", "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets", "--quant",
                 "--precision", "--optimizer", "--checkpointing", "--attn", "--batch", "--seq", "--grad-accum",
                 "--zero", "--offload-optimizer", "--offload-params", "--gpus", "--loss", "--gpu", "--gpu-memory",
                 "--json"):
        assert flag in r.stdout, flag


# ----------------------------------------------------------------------------------------------
# User errors: one line, exit 2


def test_unknown_model_suggests_close_names():
    line = assert_user_error(run("estimate", "llama-3.1-8bb"), "unknown model", "did you mean")
    assert "llama-3.1-8b" in line


def test_unknown_hub_model_offline():
    assert_user_error(run("estimate", "no-such-org/no-such-model"), "no-such-org/no-such-model")


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    assert_user_error(run("estimate", str(bad)), "not valid JSON")


def test_incomplete_config_json(tmp_path):
    from vramplan.model.profiles import load_model

    cfg = dict(load_model("smollm2-135m").config)
    del cfg["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert_user_error(run("estimate", str(path)), "hidden_size")


def test_missing_config_file(tmp_path):
    assert_user_error(run("estimate", str(tmp_path / "nope.json")), "no such file")
    assert_user_error(run("estimate", str(tmp_path)), "without a config.json")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--batch", "0"], "--batch"),
        (["--batch", "-3"], "--batch"),
        (["--seq", "0"], "--seq"),
        (["--seq", "-1"], "--seq"),
        (["--method", "lora", "--lora-rank", "0"], "--lora-rank"),
        (["--method", "lora", "--lora-rank", "-8"], "--lora-rank"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--gpus", "0"], "--gpus"),
        (["--lora-dropout", "1.5", "--method", "lora"], "--lora-dropout"),
    ],
)
def test_non_positive_sizes(args, flag):
    assert_user_error(run("estimate", "smollm2-135m", *args), flag)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--method", "full", "--quant", "nf4"], "cannot be fully fine-tuned"),
        (["--offload-params", "cpu"], "ZeRO stage 3"),
        (["--offload-optimizer", "cpu"], "needs ZeRO"),
        (["--method", "lora", "--lora-targets", "nothing_here"], "matches no Linear"),
    ],
)
def test_inconsistent_setups(args, fragment):
    assert_user_error(run("estimate", "smollm2-135m", *args), fragment)


def test_rank_larger_than_a_layer():
    # SmolLM2-135M: k_proj is 576 -> 192, so rank 256 cannot be a low-rank update of it.
    line = assert_user_error(run("estimate", "smollm2-135m", "--method", "lora", "--lora-rank", "256"),
                             "--lora-rank 256", "k_proj")
    assert "at most 192" in line
    # targeting only wider layers makes the same rank legal
    r = run("estimate", "smollm2-135m", "--method", "lora", "--lora-rank", "256", "--lora-targets", "q_proj,o_proj")
    assert r.exit_code == 0, r.output


def test_rank_check_applies_to_trace_too():
    assert_user_error(run("trace", "smollm2-135m", "--method", "lora", "--lora-rank", "4096"), "--lora-rank")


def test_unknown_gpu():
    assert_user_error(run("estimate", "smollm2-135m", "--gpu", "rtx-4099"), "unknown GPU", "rtx-4090")


@pytest.mark.parametrize("size", ["24XB", "lots", "0", "0GiB", "-1GiB", "", "9" * 400])
def test_bad_gpu_memory(size):
    assert_user_error(run("estimate", "smollm2-135m", "--gpu-memory", size), "--gpu-memory")


def test_gpu_and_gpu_memory_together():
    assert_user_error(run("estimate", "smollm2-135m", "--gpu", "rtx-4090", "--gpu-memory", "24GiB"), "not both")


def test_click_usage_errors_exit_2():
    for args in (["estimate"], ["estimate", "x", "--batch", "two"], ["estimate", "x", "--method", "dora"], ["nope"]):
        r = run(*args)
        assert r.exit_code == 2 and "Traceback" not in r.output, args


# ----------------------------------------------------------------------------------------------
# Property: whatever the user types, exit 0 or 2, never a traceback

_names = st.one_of(
    st.sampled_from(["llama-3.1-8b", "smollm2-135m", "gpt2", "qwen3-30b-a3b", "Qwen/Qwen2-0.5B", "a/b", ".", "/", "~"]),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
)
_ints = st.one_of(st.integers(-5, 70_000), st.integers(-(10**20), 10**20)).map(str)
_sizes = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"-?[0-9]{0,400}(\.[0-9]*)?\s?(k|K|M|Mi|G|GiB|GB|T|TiB|B|XB)?", fullmatch=True),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=_names,
    batch=_ints,
    seq=_ints,
    rank=_ints,
    method=st.sampled_from(["full", "lora", "qlora"]),
    gpu_memory=st.one_of(st.none(), _sizes),
)
def test_random_input_never_tracebacks(model, batch, seq, rank, method, gpu_memory):
    args = ["estimate", model, "--batch", batch, "--seq", seq, "--lora-rank", rank, "--method", method, "--json"]
    if gpu_memory is not None:
        args += ["--gpu-memory", gpu_memory]
    r = run(*args)
    assert r.exit_code in (0, 2), (args, r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    if r.exit_code == 0 and model not in ("--help", "-h"):
        json.loads(r.stdout)
    elif r.exit_code == 2:
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(("error: ", "Error: ")), r.stderr


def test_hub_id_resolves_from_the_huggingface_cache(tmp_path):
    """A Hub id whose config.json is in huggingface_hub's cache resolves without the network,
    through the real library (the layout it writes: refs/main -> snapshots/<commit>/)."""
    from vramplan.model.profiles import load_model

    repo = tmp_path / "models--some-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(load_model("smollm2-135m").config))
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "vramplan", "estimate", "some-org/tiny-llama", "--json"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params_total"] == load_model("smollm2-135m").params_total
