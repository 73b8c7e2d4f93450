"""Selective activation checkpointing (``Setup.checkpoint_every``, estimator/selective.py): the
Setup's checks, the estimate against the fake-tensor trace of transformers 5.24's own
``every_n_layers`` at full depth, the plan dimension and its cost, the emitted train.py, the
readers (TrainingArguments, torchtune 0.6.1's ac_mode/ac_option) and the writers' refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.cost.model import recompute_flops_per_token
from vramplan.estimator.selective import checkpointed_count, is_checkpointed
from vramplan.model.architecture import with_layers
from vramplan.specs import SpecError

LLAMA = "meta-llama/Llama-3.2-1B"


def _llama(layers: int = 6):
    return with_layers(load_model(LLAMA), layers)


def test_layers_checkpointed_as_transformers_places_them():
    s = Setup(checkpointing=True, checkpoint_every=3)
    assert [i for i in range(7) if is_checkpointed(s, i)] == [0, 3, 6]  # _set_gradient_checkpointing: i % k == 0
    assert checkpointed_count(s, 7) == 3 and checkpointed_count(s, 6) == 2
    assert checkpointed_count(Setup(checkpointing=True), 6) == 6 and checkpointed_count(Setup(), 6) == 0


@pytest.mark.parametrize("kwargs, words", [
    ({"checkpoint_every": 2}, "add --checkpointing"),
    ({"checkpointing": True, "checkpoint_every": 0}, "positive integer"),
    ({"checkpointing": True, "checkpoint_every": True}, "positive integer"),
])
def test_setup_refuses_a_bad_checkpoint_every(kwargs, words):
    with pytest.raises(SpecError, match=words):
        Setup(**kwargs)


@pytest.mark.parametrize("kwargs", [{"zero_stage": 2, "gpus": 2}, {"fsdp": "full_shard", "gpus": 2},
                                    {"pad_mask": True}, {"dora": True, "method": "lora"}])
def test_estimate_refuses_what_no_truth_covers(kwargs):
    with pytest.raises(SpecError, match="selective checkpointing"):
        estimate(_llama(), Setup(checkpointing=True, checkpoint_every=2, **kwargs))


def test_moe_is_refused():
    with pytest.raises(SpecError, match="MoE"):
        estimate(load_model("Qwen/Qwen3-30B-A3B"), Setup(method="lora", checkpointing=True, checkpoint_every=2))


def test_every_layer_is_the_old_checkpointing_and_k_lies_between():
    """k = 1 is exactly checkpointing as before; larger k keeps more layers in full, never more
    than no checkpointing, and recomputes ceil(L / k) layers' forward in the cost model."""
    model = _llama(16)
    s = Setup(method="lora", seq=4096, checkpointing=True)
    peaks = [estimate(model, s.replace(checkpoint_every=k)).tensor_peak_bytes for k in (1, 2, 4, 16)]
    none = estimate(model, s.replace(checkpointing=False)).tensor_peak_bytes
    assert peaks == sorted(peaks) and peaks[0] < peaks[1] < peaks[-1] < none
    full = recompute_flops_per_token(model, s)
    assert recompute_flops_per_token(model, s.replace(checkpoint_every=4)) == pytest.approx(full * 4 / 16)
    assert recompute_flops_per_token(model, s.replace(checkpointing=False)) == 0
    bd = estimate(model, s.replace(checkpoint_every=2))
    per_layer = bd.component("checkpointed_inputs") / 8
    assert per_layer == 2 * 4096 * model.hidden_size  # 8 of 16 layers keep their bf16 input
    assert bd.component("activations") > 0


@pytest.mark.parametrize("setup", [
    Setup(seq=1024, checkpointing=True, checkpoint_every=2),
    Setup(method="lora", seq=1024, checkpointing=True, checkpoint_every=4),  # layers 0 and 4 of 6
    Setup(method="lora", seq=1024, checkpointing=True, checkpoint_every=5, precision="bf16-mixed"),  # the top one
], ids=["full-k2", "lora-k4", "lora-k5-mixed"])
def test_estimate_matches_the_trace_of_every_n_layers(setup):
    """The truth: transformers' own activation_checkpointing_enable(every_n_layers=k) on fake tensors,
    at full depth (trace() does not extrapolate a selective setup); the validate bar is 5 %."""
    pytest.importorskip("torch")
    from vramplan.run.tracer import trace

    model = _llama(6)
    t, e = trace(model, setup), estimate(model, setup)
    assert t.notes == ("traced at full depth",)
    assert e.tensor_peak_bytes == pytest.approx(t.tensor_peak_bytes, rel=0.03)
    for phase in ("forward", "backward"):
        assert e.phase_peaks_bytes[phase] == pytest.approx(t.phase_peaks_bytes[phase], rel=0.03)


def test_the_trace_checkpoints_only_every_kth_layer():
    pytest.importorskip("torch")
    from vramplan.run.tracer import trace

    model = _llama(4)
    s = Setup(method="lora", seq=1024, checkpointing=True)
    every, half, none = (trace(model, x).phase_peaks_bytes["forward"]
                         for x in (s, s.replace(checkpoint_every=2), s.replace(checkpointing=False)))
    assert every < half < none


def test_validate_knob_has_cases():
    from vramplan.validate.matrix import KNOBS, matrix

    assert "selective_checkpointing" in KNOBS
    quick = [c for c in matrix(quick=True) if c.knob == "selective_checkpointing"]
    full = [c for c in matrix() if c.knob == "selective_checkpointing"]
    assert quick and len(full) >= 20 and all(c.setup.checkpoint_every > 1 for c in full)


def test_plan_picks_the_fewest_recomputed_layers_that_fit():
    """LoRA on Llama-3.1-8B at 8k tokens on an A100: every layer checkpointed is not needed; one in two is,
    and it is faster (half the recompute). Fixed --checkpoint-every 1, the plan keeps every layer."""
    import vramplan

    p = vramplan.plan("llama-3.1-8b", "a100-80gb", seq=8192, global_batch=8, method="lora")
    assert p.setup.checkpointing and p.setup.checkpoint_every == 2
    assert "checkpointing (1 layer in 2)" in vramplan.search.labels.savers_text(p.setup)
    fixed = vramplan.plan("llama-3.1-8b", "a100-80gb", seq=8192, global_batch=8, method="lora", checkpoint_every=1)
    assert fixed.setup.checkpoint_every == 1
    assert fixed.tokens_per_s < p.tokens_per_s


def test_cli_flag_and_its_errors():
    out = CliRunner().invoke(main, ["estimate", LLAMA, "--method", "lora", "--checkpointing", "--checkpoint-every",
                                    "2", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["setup"]["checkpoint_every"] == 2
    assert_user_error(CliRunner().invoke(main, ["estimate", LLAMA, "--checkpoint-every", "2"]), "add --checkpointing")
    assert_user_error(CliRunner().invoke(main, ["estimate", LLAMA, "--checkpointing", "--checkpoint-every", "0"]),
                      "--checkpoint-every", "positive")


def test_trainer_arguments_reader_maps_every_n_layers(tmp_path):
    from vramplan.readers import read_config

    cfg = tmp_path / "args.yaml"
    cfg.write_text("per_device_train_batch_size: 1\ngradient_checkpointing: true\n"
                   "gradient_checkpointing_kwargs: {use_reentrant: false, every_n_layers: 4}\n")
    assert read_config(cfg, format="hf").setup.checkpoint_every == 4


@pytest.mark.parametrize("fields, ckpt, every", [
    ("enable_activation_checkpointing: False\nac_mode: selective\nac_option: 2\n", True, 2),
    ("enable_activation_checkpointing: False\nac_mode: full\n", True, 1),
    ("enable_activation_checkpointing: True\nac_mode: selective\nac_option: 2\n", False, 1),  # neither applies
])
def test_torchtune_reader_reads_ac_mode_as_its_recipe_does(tmp_path, fields, ckpt, every):
    from vramplan.readers import read_config

    cfg = tmp_path / "8B_full.yaml"
    cfg.write_text("# tune run --nproc_per_node 8 full_finetune_distributed --config x\n"
                   "model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\nbatch_size: 2\n" + fields)
    read = read_config(cfg, format="torchtune")
    assert (read.setup.checkpointing, read.setup.checkpoint_every) == (ckpt, every)
    if every > 1:
        assert any(w.field == "ac_option" and "k-1" not in w.why and "1, 3" in w.why for w in read.warnings)


def test_torchtune_reader_refuses_op_and_ignores_ac_mode_elsewhere(tmp_path):
    from vramplan.readers import read_config

    cfg = tmp_path / "lora.yaml"
    head = "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_attn_modules: [q_proj]\n"
    cfg.write_text("# tune run full_finetune_distributed --config x\n" + head + "ac_mode: selective\nac_option: op\n")
    with pytest.raises(SpecError, match="ac_option"):
        read_config(cfg, format="torchtune")
    cfg.write_text("# tune run lora_finetune_single_device --config x\n" + head + "ac_mode: selective\nac_option: 2\n")
    read = read_config(cfg, format="torchtune")
    assert read.setup.checkpoint_every == 1 and not read.setup.checkpointing
    assert any(w.field == "ac_mode" and "read only by" in w.why for w in read.warnings)


def test_framework_writers_refuse_it():
    from vramplan.emit.hf_configs import refusal

    s = Setup(method="lora", checkpointing=True, checkpoint_every=2)
    for fmt in ("axolotl", "llamafactory", "trl"):
        assert "checkpoint_every" in refusal(fmt, s, load_model(LLAMA))


def test_readers_say_torch_compile_is_not_modelled_and_its_direction(tmp_path):
    from vramplan.readers import read_config

    cfg = tmp_path / "args.yaml"
    cfg.write_text("per_device_train_batch_size: 1\ntorch_compile: true\n")
    why = {w.field: w.why for w in read_config(cfg, format="hf").warnings}["torch_compile"]
    assert "not modelled" in why and "upper bound" in why


@pytest.mark.slow
def test_emitted_train_py_checkpoints_every_kth_layer(tmp_path):
    """The emitted train.py hands every_n_layers to the Trainer: after one CPU step of a 4-layer
    model, layers 0 and 2 are checkpointed, 1 and 3 not."""
    pytest.importorskip("torch")
    from vramplan.emit import emit_to_dir
    from vramplan.specs import Plan

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
            "max_position_embeddings": 256, "max_window_layers": 4}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("qwen2-0.5b").config, **tiny}))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    setup = Setup(method="lora", lora_rank=4, batch=1, seq=16, checkpointing=True, checkpoint_every=2)
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), tmp_path / "out")
    code = textwrap.dedent(f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("train", {str(tmp_path / "out" / "train.py")!r})
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        args = train.parse_args(["--cpu", "--max-steps", "1", "--output-dir", "o"])
        trainer = train.build_trainer(args, callbacks=[])
        trainer.train()
        from transformers.modeling_layers import GradientCheckpointingLayer
        print(json.dumps([m.gradient_checkpointing for m in trainer.model.modules()
                          if isinstance(m, GradientCheckpointingLayer)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "out", capture_output=True, text=True,
                         timeout=300, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                           **{k: v for k, v in __import__("os").environ.items()}})
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True, False]
