"""Writers (issue 15 part 2): ``vramplan emit --format axolotl,llamafactory,trl,torchtune`` and
``plan --from FILE --emit DIR``.

Every format round-trips through vramplan's own reader (emit -> read_config -> the same Setup);
TRL's config loads in TRL's own parser (``TrlParser``, what ``trl sft --config`` runs), torchtune's
``_component_`` paths resolve with torchtune's resolver and it has every key its recipe reads;
axolotl and LLaMA-Factory do not install here (they pin other torch/transformers versions), so
their key names are checked against their own argument definitions (tests/data/framework_fields.json,
extracted from their sources at the commits it names)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.emit import FORMATS, render
from vramplan.emit.frameworks import CONFIG_FILES, FRAMEWORKS, refusal
from vramplan.estimator import estimate
from vramplan.model.profiles import load_gpu, load_model
from vramplan.readers import framework_for, plan_inputs, read_config
from vramplan.specs import Plan, Setup, SpecError

DATA = Path(__file__).parent / "data"
#: the formats a reader reads back (unsloth.yaml is vramplan's own settings file for its fixed
#: unsloth_train.py, not a config users write: emitted, never read; tests/test_unsloth.py)
READ_BACK = tuple(f for f in FRAMEWORKS if f != "unsloth")
CONFIGS = DATA / "configs"
FIELDS = json.loads((DATA / "framework_fields.json").read_text())


def make_plan(setup: Setup, model: str = "llama-3.2-1b", gpu: str = "h100-80gb") -> Plan:
    spec, card = load_model(model), load_gpu(gpu)
    return Plan(model=spec.name, setup=setup, breakdown=estimate(spec, setup, card), gpu=card)


def emit(tmp_path: Path, plan: Plan, fmt: str) -> Path:
    for name, text in render(plan, [fmt]).items():
        (tmp_path / name).write_text(text)
    return tmp_path / CONFIG_FILES[fmt]


def read_back(path: Path):
    acc = path.parent / "accelerate_config.yaml"
    return read_config(path, accelerate=acc if acc.exists() else None)


def normal(setup: Setup, model: str = "llama-3.2-1b") -> Setup:
    """The same Setup up to notation: alpha as a number, all-linear as the module names."""
    targets = setup.lora_targets
    if targets == "all-linear":
        targets = ",".join(sorted({lin.name for lin in load_model(model).linears}))
    else:
        targets = ",".join(sorted(targets.split(",")))
    return setup.replace(lora_alpha=setup.alpha, lora_targets=targets)


FULL = Setup(method="full", precision="bf16", optimizer="adamw-fused", checkpointing=True, batch=4, seq=1024,
             grad_accum=2)
LORA = Setup(method="lora", lora_rank=8, lora_alpha=16, lora_dropout=0.05, lora_targets="q_proj,v_proj",
             optimizer="adamw", batch=2, seq=512)
QLORA = Setup(method="qlora", lora_rank=32, optimizer="paged-adamw-8bit", checkpointing=True, seq=2048, batch=1,
              grad_accum=8)
SETUPS = {
    "full": FULL,
    "full-mixed-8bit": FULL.replace(precision="bf16-mixed", optimizer="adamw-8bit"),
    "full-fp32-sgd": FULL.replace(precision="fp32", optimizer="sgd", checkpointing=False),
    "lora-sdpa": LORA.replace(attn="sdpa"),
    "lora-mlp-output": LORA.replace(lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"),
    "lora-int8": LORA.replace(quant="int8", precision="fp16"),
    "qlora": QLORA,
    "qlora-fp4-flash": QLORA.replace(quant="fp4", double_quant=False, attn="flash"),
    "zero3-offload": FULL.replace(gpus=4, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "zero2-lora": LORA.replace(gpus=2, zero_stage=2),
    "fsdp-offload": FULL.replace(gpus=2, fsdp="full_shard", offload_params="cpu"),
    "fsdp-lora-sgo": LORA.replace(gpus=2, fsdp="shard_grad_op"),
    "ddp": LORA.replace(gpus=2),
    "chunked-loss": FULL.replace(loss="chunked"),
    "liger": LORA.replace(liger=True),
    "dora-saved": LORA.replace(dora=True, lora_dropout=0.0, modules_to_save="lm_head"),
    "in-backward": FULL.replace(optimizer_in_backward=True, grad_accum=1),
    "padding-free": LORA.replace(padding_free=True, attn="flash"),
}

#: (setup, format) -> the words of the refusal; every other pair round-trips
REFUSED = {
    ("full-mixed-8bit", "axolotl"): "precision bf16-mixed",
    ("full-mixed-8bit", "torchtune"): "precision bf16-mixed",
    ("full-fp32-sgd", "llamafactory"): None,
    ("lora-sdpa", "torchtune"): "attn sdpa",
    ("lora-int8", "torchtune"): "a int8 base",
    ("lora-int8", "llamafactory"): None,
    ("qlora-fp4-flash", "axolotl"): "quant fp4",
    ("qlora-fp4-flash", "torchtune"): "a fp4 base",
    ("zero3-offload", "torchtune"): "zero_stage 3",
    ("zero2-lora", "torchtune"): "zero_stage 2",
    ("fsdp-lora-sgo", "axolotl"): "fsdp shard_grad_op",
    ("ddp", "torchtune"): "several GPUs without FSDP",
    ("liger", "torchtune"): "liger",
    ("dora-saved", "torchtune"): "dora",
    ("padding-free", "torchtune"): "padding_free",
    ("padding-free", "llamafactory"): "padding_free",
    **{("in-backward", fmt): "optimizer_in_backward" for fmt in ("axolotl", "llamafactory", "trl")},
    **{("chunked-loss", fmt): "loss chunked" for fmt in READ_BACK},
}


def test_the_new_formats_are_emit_formats():
    assert set(FRAMEWORKS) == {"axolotl", "llamafactory", "trl", "torchtune", "unsloth"}
    assert set(FRAMEWORKS) <= set(FORMATS)


@pytest.mark.parametrize("fmt", READ_BACK)
@pytest.mark.parametrize("name", SETUPS)
def test_emitted_config_reads_back_to_the_same_setup_or_is_refused(tmp_path, name, fmt):
    setup = SETUPS[name]
    if fmt == "trl" and setup.loss == "hf" and not setup.precision.endswith("-mixed"):
        setup = setup.replace(loss="trl")  # TRL's SFTTrainer: its fused LM head (tests/test_trl_loss.py)
    # a config of fmt reads back as run by fmt where its preparation is modelled (readers.framework_for)
    setup = setup.replace(framework=framework_for(fmt, setup.to_dict()))
    plan = make_plan(setup)
    refused = REFUSED.get((name, fmt))
    if refused:
        with pytest.raises(SpecError) as exc:
            render(plan, [fmt])
        assert str(exc.value).startswith(f"cannot emit {fmt}: ") and f"cannot express {refused}" in str(exc.value)
        return
    path = emit(tmp_path, plan, fmt)
    read = read_back(path)
    assert read.format == fmt
    assert normal(read.setup.replace(gpus=read.gpus or 1)) == normal(plan.setup)
    assert read.model == "meta-llama/Llama-3.2-1B"
    text = path.read_text()
    assert text.startswith("# vramplan ") and "config of the plan for meta-llama/Llama-3.2-1B" in text.splitlines()[0]
    if plan.setup.zero_stage:
        assert yaml.safe_load(text).get("deepspeed") == "ds_config.json"
        ds = json.loads((tmp_path / "ds_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == plan.setup.zero_stage


def test_a_knob_the_writers_do_not_map_is_refused_not_dropped():
    from vramplan.emit.hf_configs import MAPPED

    tried = 0
    for f in dataclasses.fields(Setup):
        if f.name in MAPPED or not isinstance(f.default, bool):
            continue
        for base in (LORA, FULL):
            try:
                setup = base.replace(**{f.name: not f.default})
            except SpecError:
                continue
            tried += 1
            for fmt in READ_BACK:  # (the estimate may refuse the knob too: the writer must on its own)
                assert refusal(fmt, setup, load_model("llama-3.2-1b")).startswith(f"{f.name} "), (fmt, f.name)
            break
    if not tried:
        pytest.skip("every boolean Setup knob is mapped")


def test_values_from_the_plan_are_data_in_the_yaml(tmp_path):
    """A model name with YAML/comment syntax in it stays one value: safe_dump quotes it."""
    from vramplan.emit.hf_configs import trl_config

    hostile = "org/x: 1\n# y: [2]"
    cfg = trl_config(FULL, load_model("llama-3.2-1b"), model_id=hostile)
    assert yaml.safe_load(yaml.safe_dump(cfg))["model_name_or_path"] == hostile


# -- the frameworks' own parsers -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "full-mixed-8bit", "qlora", "lora-int8", "zero2-lora"])
def test_trl_config_loads_in_trls_own_parser(tmp_path, monkeypatch, name):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    setup = SETUPS[name]
    plan = make_plan(setup if setup.precision.endswith("-mixed") else setup.replace(loss="trl"))
    path = emit(tmp_path, plan, "trl")
    monkeypatch.chdir(tmp_path)  # deepspeed: ds_config.json is relative to where trl runs
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))  # trl/scripts/sft.py
    _, args, model_args, _ = parser.parse_args_and_config(["--config", str(path), "--output_dir", str(tmp_path),
                                                             "--use_cpu", "true"])  # bf16 needs a GPU otherwise
    s = plan.setup
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_length) == (
        s.batch, s.grad_accum, s.seq)
    assert args.gradient_checkpointing is s.checkpointing and args.packing is False
    assert str(getattr(args.optim, "value", args.optim)) == {
        "adamw-fused": "adamw_torch_fused", "adamw-8bit": "adamw_bnb_8bit", "adamw": "adamw_torch",
        "paged-adamw-8bit": "paged_adamw_8bit"}[s.optimizer]
    assert args.bf16 is s.precision.startswith("bf16")
    assert model_args.dtype == {"bf16": "bfloat16", "bf16-mixed": "float32", "fp16": "float16"}[s.precision]
    assert model_args.use_peft is s.adapters
    if s.adapters:
        assert (model_args.lora_r, model_args.lora_alpha) == (s.lora_rank, s.alpha)
        assert model_args.load_in_4bit is (s.method == "qlora") and model_args.load_in_8bit is (s.quant == "int8")
    if s.zero_stage:
        assert args.deepspeed == "ds_config.json"


def _components(node, out):
    if isinstance(node, dict):
        if "_component_" in node:
            out.append(node["_component_"])
        for v in node.values():
            _components(v, out)
    return out


#: torchtune 0.6.1's public names per module and the ``cfg.KEY``s of each recipe, read from its wheel's
#: source (tests/data/make_torchtune_index.py): torchtune 0.6.1 needs torchao < 0.14, which peft 0.21
#: refuses for every LoRA layer, so it cannot be installed beside the rest of the test extra.
TORCHTUNE = json.loads((Path(__file__).parent / "data" / "torchtune_0.6.1.json").read_text())


def _recipe_keys(recipe: str) -> set[str]:
    """The keys torchtune 0.6.1's recipe reads as ``cfg.KEY`` (a missing one is an AttributeError)."""
    return set(TORCHTUNE["recipe_cfg_keys"][recipe])


def _resolves(component: str) -> bool:
    """What torchtune's ``_get_component_from_path`` does (import the module, get the attribute): for
    torchtune's own paths against its source index, for torch's and bitsandbytes' by importing them."""
    module, _, name = component.rpartition(".")
    if component.startswith("torchtune."):
        return name in TORCHTUNE["modules"].get(module, ())
    import importlib

    return callable(getattr(importlib.import_module(module), name, None))


@pytest.mark.parametrize("name", ["full", "lora-mlp-output", "qlora", "fsdp-offload", "fsdp-lora-sgo"])
def test_torchtune_config_resolves_in_torchtune(tmp_path, name):
    from vramplan.emit.torchtune import recipe

    plan = make_plan(SETUPS[name])
    path = emit(tmp_path, plan, "torchtune")
    data = yaml.safe_load(path.read_text())  # torchtune loads it with OmegaConf.load: plain YAML, no interpolation
    for component in _components(data, []):
        assert _resolves(component), component
    missing = _recipe_keys(recipe(plan.setup)) - set(data)
    assert not missing, f"{recipe(plan.setup)} reads {sorted(missing)}"
    runs = [line for line in path.read_text().splitlines() if "tune run" in line]
    assert runs and recipe(plan.setup) in runs[0]


@pytest.mark.parametrize("torchtune_model", ["qwen2-0.5b", "gemma-2-2b", "codellama/CodeLlama-7b-hf", "llama-2-7b",
                                             "google/gemma-2b"])
def test_torchtune_builders_and_tokenizers_exist_for_other_families(tmp_path, torchtune_model):
    spec = load_model(torchtune_model)
    plan = Plan(model=spec.name, setup=LORA, breakdown=estimate(spec, LORA, load_gpu("h100-80gb")))
    data = yaml.safe_load(render(plan, ["torchtune"])["torchtune.yaml"])
    for component in _components(data, []):
        assert _resolves(component), component
    assert read_back(emit(tmp_path, plan, "torchtune")).model == spec.name


@pytest.mark.parametrize("name", list(SETUPS))
def test_axolotl_and_llamafactory_keys_are_their_own_fields(name):
    import transformers

    plan = make_plan(SETUPS[name])
    hf = {f.name for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)}
    axolotl = set(FIELDS["axolotl"]["fields"]) | set(FIELDS["axolotl"]["liger_plugin"]["fields"])
    for fmt, allowed in (("axolotl", axolotl),
                         ("llamafactory", set(FIELDS["llamafactory"]["fields"]) | hf)):
        if REFUSED.get((name, fmt)):
            continue
        data = yaml.safe_load(render(plan, [fmt])[CONFIG_FILES[fmt]])
        assert set(data) <= allowed, f"{fmt}: not its fields: {sorted(set(data) - allowed)}"
        if "fsdp_config" in data:
            assert set(data["fsdp_config"]) <= set(FIELDS["axolotl"]["fsdp_config"])


def test_the_field_lists_name_their_source():
    for fmt, repo in (("axolotl", "axolotl-ai-cloud/axolotl"), ("llamafactory", "hiyouga/LLaMA-Factory")):
        entry = FIELDS[fmt]
        assert entry["repo"] == repo and re.fullmatch(r"[0-9a-f]{40}", entry["commit"])
        sources = json.loads((CONFIGS / fmt / "SOURCES.json").read_text())
        assert {v["commit"] for v in sources.values()} == {entry["commit"]}  # the readers' commit too
        assert len(entry["fields"]) > 200


def test_emit_command_writes_a_framework_and_says_how_to_run_it(tmp_path):
    plan_file = tmp_path / "plan.yaml"
    from vramplan.plans.planfile import save_plan

    save_plan(make_plan(SETUPS["zero2-lora"]), plan_file)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["emit", str(plan_file), "--format", "axolotl,llamafactory", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["accelerate_config.yaml", "axolotl.yaml", "ds_config.json",
                                                      "llamafactory.yaml", "vramplan.json"]
    assert "run: cd" in result.stderr and "-m axolotl.cli.train axolotl.yaml" in result.stderr
    save_plan(make_plan(SETUPS["zero3-offload"]), plan_file)
    assert_user_error(CliRunner().invoke(main, ["emit", str(plan_file), "--format", "torchtune", "--out",
                                                str(tmp_path / "x")]),
                      "cannot emit torchtune: torchtune cannot express zero_stage 3")
    assert not (tmp_path / "x").exists()


# -- plan --from FILE --emit DIR ---------------------------------------------------------------------

#: (corpus file, MODEL, GPU, more flags); the axolotl files pack (sample_packing with flash attention:
#: padding-free), which the plan keeps
WRITE_BACK = [
    ("axolotl/qlora-1b.yml", "llama-3.2-1b", "t4", ()),
    ("axolotl/lora-1b.yml", "llama-3.2-1b", "t4", ()),
    ("trl/zephyr-7b-beta-sft-config_full.yaml", "llama-3.2-1b", "rtx-4090", ()),
    ("trl/zephyr-7b-beta-sft-config_qlora.yaml", "llama-3.2-1b", "t4", ()),
    ("llamafactory/qwen3_lora_sft_ds3.yaml", "qwen3-4b", "t4", ("--gpus", "2")),
    ("torchtune/llama3_2_1B_full_single_device.yaml", None, "t4", ()),
    ("torchtune/llama3_1_8B_lora_single_device.yaml", None, "rtx-4090", ()),
    # do_eval at the Trainer's default eval batch 8 x 2048 tokens: ~24 GiB of eval logits, a T4 cannot
    ("hf/cbdetect-training_args.json", "llama-3.2-1b", "a100-40gb", ()),
]


@pytest.mark.parametrize("rel,model,gpu,extra", WRITE_BACK, ids=[w[0] for w in WRITE_BACK])
def test_plan_from_file_writes_the_file_back_with_only_the_changes(tmp_path, rel, model, gpu, extra):
    fmt = rel.split("/")[0]
    shutil.copytree(CONFIGS / fmt, tmp_path / fmt)  # the files it names resolve as in the corpus
    src = tmp_path / rel
    before = src.read_bytes()
    out = src.parent / "planned"
    args = ["plan", *([model] if model else []), "--from", str(src), "--gpu", gpu, *extra, "--emit", str(out),
            "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    changes = planned["from_config"]["changes"]
    assert changes, "the case should change something"
    assert src.read_bytes() == before  # the user's file is untouched
    written = out / src.name
    old, new = before.decode().splitlines(), written.read_text().splitlines()
    notes = (out / "vramplan-changes.md").read_text()
    for c in changes:
        assert f"{c['field']} " in notes
    if src.suffix == ".json":
        assert json.loads(written.read_text()).keys() >= json.loads(before).keys() - {"deepspeed"}
    else:
        assert len(new) >= len(old)
        differing = [(a, b) for a, b in zip(old, new, strict=False) if a != b]
        assert differing and all("# vramplan: " in b for _, b in differing)
        assert all("# vramplan: " in b for b in new[len(old):])
        for a, b in differing:  # the user's own comment on a changed line is kept
            if "#" in a and not b.lstrip().startswith("#"):
                assert a[a.index("#"):] in b
    read = read_back(written)
    # what the file leaves to the card (bf16: auto) read as the plan's card reads it
    as_run = plan_inputs(read, model, gpu=load_gpu(gpu)).setup
    assert normal(as_run.replace(gpus=planned["setup"]["gpus"]), model or read.model) == normal(
        Setup(**planned["setup"]), model or read.model)


def test_plan_from_file_emit_refuses_what_the_file_cannot_carry(tmp_path):
    src = CONFIGS / "torchtune/llama3_2_1B_full_single_device.yaml"
    result = CliRunner().invoke(main, ["plan", "--from", str(src), "--gpu", "t4", "--method", "lora",
                                       "--emit", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output and "changes vs" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]  # after the reader's warnings about the file
    assert last.startswith("error: cannot write the plan back into a torchtune config: it changes method full -> lora")
    assert not (tmp_path / "o").exists()


def test_plan_emit_without_from_is_unchanged(tmp_path):
    result = CliRunner().invoke(main, ["plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--method", "lora",
                                       "--emit", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["accelerate_config.yaml", "config.json",
                                                                   "launch.sh", "train.py", "vramplan.json"]


def test_the_line_editor_keeps_everything_but_the_edited_values():
    from vramplan.emit.writeback import Edit, edit_yaml

    text = ("# my run\n"
            "a: 1  # keep me\n"
            "lst:\n"
            "  - x\n"
            "  - y\n"
            "opt:\n"
            "  _component_: torch.optim.AdamW\n"
            "  fused: True\n"
            "\n"
            "z: last\n")
    edits = [Edit("a", 2, False, "why a"), Edit("lst", ["q: 1", "w"], False, "why lst"),
             Edit("opt.fused", None, True, "why fused"), Edit("opt.lr", 0.1, False, "why lr"),
             Edit("new.deep.key", "x#y", False, "why new"), Edit("gone", None, True, "nothing")]
    out = edit_yaml(text, edits, "t.yaml")
    assert yaml.safe_load(out) == {"a": 2, "lst": ["q: 1", "w"], "opt": {"_component_": "torch.optim.AdamW", "lr": 0.1},
                                   "z": "last", "new": {"deep": {"key": "x#y"}}}
    lines = out.splitlines()
    assert lines[0] == "# my run" and lines[1].startswith("a: 2  # keep me  # vramplan: was 1; why a")
    assert "  # fused: True  # vramplan: removed; why fused" in lines
    assert "  lr: 0.1  # vramplan: added; why lr" in lines
    assert "z: last" in lines and "" in lines
    with pytest.raises(SpecError, match="flow mapping"):
        edit_yaml("m: {a: 1}\n", [Edit("m.b", 1, False, "w")], "t.yaml")
    with pytest.raises(SpecError, match="not valid YAML"):
        edit_yaml("a: [1\n", [Edit("a", 1, False, "w")], "t.yaml")


def test_a_plan_keeps_the_files_packing_and_leaves_bf16_auto_to_the_card(tmp_path):
    """qlora-1b.yml packs (sample_packing + flash: padding-free) and says ``bf16: auto``: the plan
    keeps the packing, and on a T4 (no bf16) plans axolotl's fp16 fallback, so ``bf16: auto`` stays;
    the T4 cannot run the file's FlashAttention-2, and the plan says so."""
    src = CONFIGS / "axolotl/qlora-1b.yml"
    result = CliRunner().invoke(main, ["plan", "llama-3.2-1b", "--from", str(src), "--gpu", "t4", "--json",
                                       "--emit", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["setup"]["padding_free"] and out["setup"]["precision"] == "fp16"
    assert out["from_config"]["setup"]["precision"] == "fp16"  # as written, on this card
    assert "precision" not in {c["field"] for c in out["from_config"]["changes"]}
    written = yaml.safe_load(next((tmp_path / "o").glob("*.yml")).read_text())
    assert written["sample_packing"] is True and written["bf16"] == "auto"
    assert any("cannot run FlashAttention-2" in n for n in out["notes"])


def test_plan_from_a_command_line_refuses_to_write_it_back(tmp_path):
    cmd = tmp_path / "run.sh"
    cmd.write_text("trl sft --model_name_or_path meta-llama/Llama-3.2-1B --per_device_train_batch_size 8 "
                   "--max_length 2048 --use_peft --lora_r 16 --dataset_name x\n")
    result = CliRunner().invoke(main, ["plan", "--from", str(cmd), "--gpu", "rtx-4090", "--emit", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write the plan back into {cmd}: it is a command line, not a config file; write the plan as "
        "a config with --out PLAN, then vramplan emit PLAN --format trl")
    assert not (tmp_path / "o").exists()
