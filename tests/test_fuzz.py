"""Fuzz (issue 14): random argument lists and malformed files for estimate, plan, emit and check,
run in-process through click's CliRunner. Every outcome must be an exit 0, 1 or 2 with at most one
``error:`` line; any other exception (a traceback) fails. Bounded and derandomized, so CI runs
the same few hundred cases every time."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.cli import main

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

NUMBERS = st.sampled_from(["0", "-1", "1", "2", "3", "7", "64", "4096", "65536", "1e9", "1e30", "nan", "inf", "1.5",
                           "9" * 300, "", " ", "abc", "1M", "24GiB", "-0", "0x10", "１"])
TEXT = st.sampled_from(["", "x", "[/]", "[bold]x", "\n", "a\nb", "$(touch x)", "a,b", "all-linear", "q_proj",
                        "\x00", "é", "..", "/", "-"])
CHOICES = {
    "--method": ["full", "lora", "qlora", "x"], "--optimizer": ["adamw", "sgd", "lion", "adamw-8bit", "x"],
    "--quant": ["none", "nf4", "int8", "gptq", "awq", "x"], "--zero": ["0", "1", "2", "3", "4"],
    "--fsdp": ["none", "full_shard", "shard_grad_op", "no_shard"], "--offload-params": ["none", "cpu", "nvme"],
    "--offload-optimizer": ["none", "cpu", "nvme"], "--precision": ["bf16", "fp16", "fp32", "bf16-mixed"],
    "--attn": ["auto", "eager", "sdpa", "flash"], "--loss": ["hf", "chunked"],
    "--gpu": ["l4", "a100", "rtx-4090", "t4", "nope", "[/]", ""],
}
COUNT_FLAGS = ["--batch", "--seq", "--grad-accum", "--gpus", "--lora-rank", "--lora-alpha", "--quant-bits",
               "--quant-group-size", "--lora-dropout", "--gpu-memory"]
PLAN_FLAGS = ["--global-batch", "--tokens-per-step", "--dataset-tokens", "--nodes", "--host-ram"]
SWITCHES = ["--checkpointing", "--no-checkpointing", "--pad-mask", "--json", "--no-quant", "--nvme", "--bogus"]
MODELS = st.sampled_from(["smollm2-135m", "qwen2-0.5b", "llama-3.1-8b", "nope", "", "[/nope]", "a/b/c"])


def _option():
    choice = st.sampled_from(sorted(CHOICES)).flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(CHOICES[f])))
    count = st.tuples(st.sampled_from(COUNT_FLAGS + PLAN_FLAGS), NUMBERS)
    text = st.tuples(st.just("--lora-targets"), TEXT)
    switch = st.sampled_from(SWITCHES).map(lambda s: (s,))
    return st.one_of(choice, count, text, switch)


def _assert_clean(result) -> None:
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{result.output}") from exc
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1 and "Traceback" not in result.output, result.stderr
    if result.exit_code == 2:
        assert len(errors) == 1, result.stderr


@FUZZ
@given(command=st.sampled_from(["estimate", "plan"]), model=MODELS, options=st.lists(_option(), max_size=5))
def test_fuzz_estimate_and_plan(command, model, options):
    args = [command, model, *[part for option in options for part in option]]
    if command == "plan" and "--gpu" not in args and "--gpu-memory" not in args:
        args += ["--gpu", "l4"]
    _assert_clean(CliRunner().invoke(main, args))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**20), max_value=10**20),
              st.sampled_from([10**400, -1, 0, 1, 2, 512, 1.5]), st.floats(allow_nan=False, allow_infinity=False),
              TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6)
SETUP_KEYS = ["method", "lora_rank", "lora_targets", "zero_stage", "batch", "seq", "gpus", "grad_accum",
              "offload_params", "fsdp", "optimizer", "checkpointing", "precision", "quant", "unknown"]
PLAN_KEYS = ["vramplan_plan", "model", "gpu", "nodes", "setup", "tokens_per_s", "step_time_s", "alternatives",
             "rejected", "notes", "breakdown"]


def _plan_data():
    setup = st.dictionaries(st.sampled_from(SETUP_KEYS), JSON_VALUES, max_size=4)
    base = st.fixed_dictionaries({"vramplan_plan": st.just(1), "model": st.just("smollm2-135m"), "setup": setup})
    return st.tuples(base, st.dictionaries(st.sampled_from(PLAN_KEYS), JSON_VALUES, max_size=3)).map(
        lambda pair: {**pair[0], **pair[1]})


@FUZZ
@given(data=_plan_data(), suffix=st.sampled_from([".json", ".yaml"]))
def test_fuzz_plan_files_through_emit_and_check(data, suffix):
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"plan{suffix}"
        text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data)
        path.write_text(text)
        _assert_clean(CliRunner().invoke(main, ["emit", str(path), "--out", str(Path(tmp) / "out")]))
        _assert_clean(CliRunner().invoke(main, ["check", str(path), "--baseline", str(Path(tmp) / "b.json")]))


CHECK_KEYS = ["name", "model", "gpu", "gpu_memory", "setup", "must_fit", "tolerance", "unknown"]


@FUZZ
@given(entries=st.lists(st.dictionaries(st.sampled_from(CHECK_KEYS), JSON_VALUES, max_size=5), max_size=3),
       baseline=JSON_VALUES)
def test_fuzz_checks_files_and_baselines(entries, baseline):
    with tempfile.TemporaryDirectory() as tmp:
        for e in entries:
            e.setdefault("model", "smollm2-135m")
        checks = Path(tmp) / "checks.json"
        checks.write_text(json.dumps({"checks": entries}))
        base = Path(tmp) / "base.json"
        base.write_text(json.dumps(baseline))
        _assert_clean(CliRunner().invoke(main, ["check", str(checks), "--baseline", str(base)]))
