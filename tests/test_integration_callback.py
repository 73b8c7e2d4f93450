"""VramplanCallback (vramplan.integrations.transformers) in real Trainer runs on the CPU: a tiny
random Llama (vramplan.truths.tiny's shape), full fine-tune and peft LoRA under transformers'
Trainer, and TRL 1.16's SFTTrainer. For each: the Setup the callback builds equals the Setup the
run's arguments describe, the estimate is logged, the live-tensor peak is measured against it,
and the record it appends is read by the real ``vramplan calibrate`` fit."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramplan.calibration import measure  # noqa: E402
from vramplan.calibration.calibrate import fit  # noqa: E402
from vramplan.specs import Setup  # noqa: E402
from vramplan.truths.tiny import tiny_config  # noqa: E402

SEQ = 32
ROOT = Path(__file__).resolve().parents[1]


def _model(dtype=torch.float32):
    from vramplan.run.models import hf_config

    torch.manual_seed(0)
    cfg = hf_config(tiny_config(), None)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


class _Tokens(torch.utils.data.Dataset):
    """Random token rows of SEQ tokens, labels = inputs (what the emitted train.py trains on)."""

    def __init__(self, n: int = 16, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 512, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=3, report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
                optim="adamw_torch", dataloader_num_workers=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def _train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


@pytest.fixture
def records(tmp_path):
    return tmp_path / "records"


def test_full_fine_tune_setup_estimate_and_record(tmp_path, records, caplog):
    from vramplan.integrations.transformers import VramplanCallback

    cb = VramplanCallback(gpu="rtx-4090", record_to=records)
    args = _args(tmp_path, activation_checkpointing=True)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_Tokens(), callbacks=[cb])
    with caplog.at_level(logging.INFO, logger="vramplan.integrations.transformers"):
        _train(trainer)
    # no max_length in TrainingArguments and no seq=: the first batch's length, read at the first forward
    assert cb.first_batch_shape == (2, SEQ)
    expected = Setup(method="full", precision="fp32", optimizer="adamw", checkpointing=True, attn="sdpa", batch=2,
                     seq=SEQ, grad_accum=2, gpus=1)
    assert cb.setup == expected
    assert cb.trainer_setup.spec.hidden_size == 64 and cb.trainer_setup.spec.num_layers == 2
    logged = caplog.text
    assert "sequence length 32 from the first batch" in logged and "fits on" in logged
    # measured: the live-tensor counter over the first steps, compared with the estimate
    got = cb.measurement.measured
    assert got["device"] == "cpu" and got["steps_done"] == 3 and got["counted_steps"] == 2
    assert got["tensor_peak_bytes"] > 0 and {"forward", "backward", "optimizer"} <= set(got["tensor_phase_peaks_bytes"])
    assert "tensor peak" in logged and "measured vs" in logged
    # the record: the measurement schema, read back, and accepted by calibrate's fit
    assert cb.record_path == records / "cpu.jsonl"
    rows = measure.read_records(records)
    assert len(rows) == 1 and rows[0]["setup"] == expected.to_dict() and rows[0]["key"] == cb.measurement.key
    _schema_check("measurement", rows[0])
    result = fit(rows)
    assert result["records_seen"] == 1 and result["runs"] == 0  # a CPU run: seen, not a CUDA fit row
    # the command itself on that directory (into a temporary file: the repository's fit is untouched)
    from click.testing import CliRunner

    from vramplan.cli import main

    out = tmp_path / "coefficients.json"
    run = CliRunner().invoke(main, ["calibrate", "--records", str(records), "--out", str(out), "--no-published",
                                    "--no-ship"])
    assert run.exit_code == 0, run.output
    assert json.loads(out.read_text())["records_seen"] == 1
    # the Measure hooks are gone: later steps ran without them
    assert not trainer.model._forward_pre_hooks and not trainer.model._forward_hooks


def test_lora_with_peft_and_seq_argument(tmp_path, records, caplog):
    import peft

    from vramplan.integrations.transformers import VramplanCallback

    model = peft.get_peft_model(_model(torch.bfloat16), peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM"))
    # a 100 MiB card: the estimate (CUDA context included) does not fit, a warning at train start
    cb = VramplanCallback(seq=SEQ, gpu=100 * 2**20, record_to=records / "mine.jsonl", measure_steps=2)
    args = _args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=1, bf16=True)
    with caplog.at_level(logging.WARNING, logger="vramplan.integrations.transformers"):
        _train(transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]))
    assert "will NOT fit" in caplog.text and "MiB short" in caplog.text and cb.breakdown.fits is False
    expected = Setup(method="lora", lora_rank=8, lora_alpha=16, lora_dropout=0.1, lora_targets="q_proj,v_proj",
                     precision="bf16", optimizer="adamw", attn="sdpa", batch=1, seq=SEQ, grad_accum=1)
    assert cb.setup == expected
    assert cb.measurement.steps == 2 and cb.measurement.measured["steps_done"] == 2
    assert cb.record_path == records / "mine.jsonl"
    assert fit(measure.read_records(records))["records_seen"] == 1


def test_trl_sft_trainer_in_a_fresh_process():
    """The live-tensor comparison below runs in its own interpreter, as a user's training run does:
    in the test process a fake-tensor trace run earlier (any ``vramplan.run.tracer.trace``) leaves
    state behind that makes the counter see ~1 TB during SFTTrainer's step (cause not found yet;
    the trace's patches, dispatch modes, hooks, accelerate state and environment are restored)."""
    import os
    import subprocess
    import sys

    if os.environ.get("VRAMPLAN_FRESH_PROCESS"):
        pytest.skip("already the fresh process")
    env = {**os.environ, "VRAMPLAN_FRESH_PROCESS": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_trl_sft_trainer"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout


def test_trl_sft_trainer(tmp_path, records):
    import os

    if not os.environ.get("VRAMPLAN_FRESH_PROCESS"):
        pytest.skip("run by test_trl_sft_trainer_in_a_fresh_process")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import peft

    from vramplan.integrations.transformers import VramplanCallback

    model = _model()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), eos_token="</s>", pad_token="<pad>")
    ds = datasets.Dataset.from_dict({"text": [" ".join(f"w{i % 50}" for i in range(j, j + 40)) for j in range(16)]})
    config = trl.SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                           max_length=24, report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
                           bf16=False, optim="adamw_torch", disable_tqdm=True, dataset_num_proc=None)
    cb = VramplanCallback(record_to=records)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[cb],
                             peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                         task_type="CAUSAL_LM"))
    _train(trainer)
    # TRL's defaults: activation checkpointing on; max_length is the sequence length; peft's
    # all-linear (expanded by peft to every Linear but the head) reads back as all-linear
    expected = Setup(method="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_targets="all-linear",
                     precision="fp32", optimizer="adamw", checkpointing=True, attn="sdpa", batch=2, seq=24,
                     grad_accum=1, loss="trl")
    assert cb.setup == expected
    assert cb.first_batch_shape is not None and cb.first_batch_shape[0] == 2
    # TRL 1.16's fused LM head replaces transformers' loss in SFT: modelled as --loss trl (its torch
    # fold on the CPU), so the measured live-tensor peak is the estimate's
    got = measure.comparison(cb.measurement)["tensor_peak_bytes"]
    assert abs(got["error"]) < 0.05, got
    assert fit(measure.read_records(records))["records_seen"] == 1


def test_an_error_in_the_callback_is_a_log_line_and_training_goes_on(tmp_path, caplog):
    """A GPU name vramplan does not know: the run still trains; the failure is one log line."""
    from vramplan.integrations.transformers import VramplanCallback

    cb = VramplanCallback(gpu="no-such-gpu")
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path, max_steps=1), train_dataset=_Tokens(4),
                                   callbacks=[cb])
    with caplog.at_level(logging.WARNING, logger="vramplan.integrations.transformers"):
        _train(trainer)
    assert trainer.state.global_step == 1
    assert "the callback is off for this run" in caplog.text and cb.measurement is None


def test_estimate_path_does_not_import_the_integration():
    import subprocess
    import sys

    code = ("import sys, vramplan, vramplan.cli, vramplan.readers, vramplan.estimator; "
            "print(any(m.startswith('vramplan.integrations') for m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _schema_check(name: str, instance) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schemas = [json.loads(p.read_text()) for p in (ROOT / "docs" / "schema").glob("*.schema.json")]
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas])
    by_name = {s["$id"].rsplit(":", 1)[-1]: s for s in schemas}
    jsonschema.Draft202012Validator(by_name[name], registry=registry).validate(instance)


def test_qlora_base_modules_to_save_and_a_trl_objective_read_off_the_model(tmp_path):
    """A real bitsandbytes 4-bit base (loaded on the CPU), prepared and wrapped by peft: the Setup
    is read off the model (its quantization_config, the adapted and saved modules, and the
    checkpointing prepare_model_for_kbit_training turned on), not only off the arguments."""
    pytest.importorskip("bitsandbytes")
    import peft
    import trl

    from vramplan.integrations.trainer_setup import setup_from_trainer

    _model(torch.bfloat16).save_pretrained(tmp_path / "base")
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant,
                                                                  dtype=torch.bfloat16, device_map="cpu")
        model = peft.prepare_model_for_kbit_training(model)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                           modules_to_save=["lm_head"], task_type="CAUSAL_LM"))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, report_to="none",
                                          per_device_train_batch_size=4)
    read = setup_from_trainer(args, model, seq=64)
    assert read.setup() == Setup(method="qlora", lora_rank=8, lora_alpha=16, lora_targets="all-linear", quant="nf4",
                                 double_quant=True, precision="bf16", optimizer="adamw-fused", checkpointing=True,
                                 attn="sdpa", batch=4, seq=64, modules_to_save="lm_head")
    assert any(w.field == "activation_checkpointing" and w.kind == "assumed" for w in read.warnings)
    dpo = trl.DPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_length=128)
    got = setup_from_trainer(dpo, model).setup()
    assert (got.objective, got.seq, got.checkpointing) == ("dpo", 128, True)
