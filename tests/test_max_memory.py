"""``--max-memory`` for the layer split: accelerate 1.15's reading of the caps, the Setup field,
the placement against transformers 5.24's own under the same caps (meta-device model), each
GPU's memory against the per-GPU traced step, the refusals (offload off the GPUs, bad input),
the emitted train.py and the readers."""

from __future__ import annotations

import ast
import json

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main as cli
from vramplan.emit.trainer import script_plan, train_script
from vramplan.estimator.layer_split import place
from vramplan.setup.max_memory import accelerate_size, caps_text, max_memory_map, parse_max_memory
from vramplan.specs import Plan, SpecError

GiB = 2**30


# ----------------------------------------------------------------------------------------------
# reading the caps


@pytest.mark.parametrize("text", ["20GiB", "20 GiB", "1.5GiB", "512MiB", "64KiB", "20GB", "20gb", "20Gb", "20MB",
                                  "7.5mb", "3KB", "20gib"])
def test_sizes_read_as_accelerate_reads_them(text):
    from accelerate.utils.modeling import convert_file_size_to_int

    assert accelerate_size(text) == convert_file_size_to_int(text)


def test_a_plain_number_is_bytes_and_the_caps_keep_gpu_order():
    assert parse_max_memory("1=24GiB,0=20GiB") == (20 * GiB, 24 * GiB)
    assert parse_max_memory("0=21474836480, 1=20Gb") == (20 * GiB, 2_500_000_000)  # "Gb": bits, as accelerate
    assert caps_text((20 * GiB, 512 << 20, 20_000_000_000)) == "0=20GiB,1=512MiB,2=20000000000"
    assert max_memory_map((20 * GiB, 24 * GiB)) == {0: 20 * GiB, 1: 24 * GiB}


@pytest.mark.parametrize("text,fragment", [
    ("0=20GiB,0=24GiB", "GPU 0 twice"),
    ("1=20GiB", "leaves out GPU 0"),
    ("0=20GiB,cpu=64GiB", "cpu= is accelerate's budget for layers offloaded"),
    ("0=20GiB,disk=1TB", "disk= is accelerate's budget"),
    ("cuda:0=20GiB", "not a GPU index"),
    ("0=20", "did you mean 20GiB"),
    ("0=20G", "not a size accelerate reads"),
    ("0=infGiB", "not a size accelerate reads"),
    ("0=-1GiB", "not a size accelerate reads"),
    ("0=0GiB", "no memory"),
    ("0=2000000TiB", "not a size"),
    ("0=2000000GiB", "more than 1 PiB"),
    ("20GiB", "not INDEX=SIZE"),
    ("0=", "not INDEX=SIZE"),
    ("0=1GiB," * 2000, "longer than"),
])
def test_bad_caps_are_one_line(text, fragment):
    with pytest.raises(SpecError, match=fragment) as exc:
        parse_max_memory(text)
    assert "\n" not in str(exc.value)


def test_setup_field_defaults_off_and_checks_its_neighbours():
    assert Setup().max_memory == () and Setup().to_dict()["max_memory"] == []
    s = Setup(gpus=2, device_map="auto", max_memory=[20 * GiB, 24 * GiB])  # a plan file's list
    assert s.max_memory == (20 * GiB, 24 * GiB) and hash(s)
    assert Setup(gpus=2, device_map="auto", max_memory={0: "20GiB", 1: 24 * GiB}).max_memory == s.max_memory
    assert Setup.from_dict(s.to_dict()) == s
    with pytest.raises(SpecError, match="add --device-map"):
        Setup(gpus=2, max_memory=(20 * GiB, 24 * GiB))
    with pytest.raises(SpecError, match="3 GPU caps for 2 GPUs"):
        Setup(gpus=2, device_map="auto", max_memory=(GiB, GiB, GiB))
    with pytest.raises(SpecError, match="one integer of bytes per GPU"):
        Setup(gpus=2, device_map="auto", max_memory=(GiB, "x"))


def test_plan_file_round_trip(tmp_path):
    from vramplan.plans.planfile import load_plan, save_plan

    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-3090")
    setup = Setup(method="lora", gpus=2, device_map="auto", max_memory=(GiB, 4 * GiB))
    path = tmp_path / "plan.yaml"
    save_plan(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), path)
    assert load_plan(path).setup == setup


@pytest.mark.parametrize("args,fragment", [
    (["--max-memory", "0=8GiB,cpu=1GiB"], "cpu= is accelerate's budget"),
    (["--max-memory", "0=8GiB,1=8GiB"], "add --device-map"),
    (["--max-memory", "0=8GiB", "--device-map", "auto"], "1 GPU caps for 2 GPUs"),
    (["--max-memory", "0=1GiB,1=1GiB", "--device-map", "auto"], "on no GPU"),
])
def test_cli_refuses_in_one_line(args, fragment):
    out = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", "--method", "lora", "--gpus", "2", "--gpu",
                                   "rtx-3090", *args])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], out.stderr


# ----------------------------------------------------------------------------------------------
# the placement, against transformers' own under the same caps


def _cases():
    """The validate matrix's capped cases; the 70B QLoRA (its meta model is the slow one) marked slow."""
    from vramplan.truths.max_memory_truth import CASES

    return [pytest.param(*c, marks=pytest.mark.slow) if "70B" in c[0] else c for c in CASES]


@pytest.mark.parametrize("name,kw,caps", _cases())
def test_capped_placement_is_transformers_own(name, kw, caps):
    from vramplan.truths.layer_split_truth import layer_devices, placed_bytes
    from vramplan.truths.max_memory_truth import capped_device_map, capped_setup

    model, setup = load_model(name), capped_setup(kw, caps)
    split = place(model, setup, None, 0)
    real = capped_device_map(model.config, setup)
    assert split.layer_devices() == layer_devices(real, model.num_layers)
    assert dict(split.placement) == real  # embeddings, norm, rotary embedding and head too
    truth = placed_bytes(model.config, setup, real)
    for r in range(setup.gpus):
        assert split.placed_bytes[r] == pytest.approx(truth.get(r, 0), rel=1e-4, abs=4096)


def test_caps_move_the_split():
    model, gpu = load_model("llama-3.1-8b"), load_gpu("rtx-3090")
    free = place(model, Setup(method="lora", gpus=2, device_map="auto"), gpu, 0)
    capped = place(model, Setup(method="lora", gpus=2, device_map="auto", max_memory="0=8GiB,1=20GiB"), gpu, 0)
    assert [len(free.layers_on(r)) for r in range(2)] == [16, 16]
    assert [len(capped.layers_on(r)) for r in range(2)] == [14, 18]
    # sequential fills GPU 0 to its cap less the largest layer (the "main device" keeps room for one)
    seq = place(model, Setup(method="lora", gpus=2, device_map="sequential", max_memory="0=6GiB,1=12GiB"), None, 0)
    assert seq.placed_bytes[0] <= 6 * GiB - 128256 * 4096 * 2


def test_what_fits_on_no_gpu_is_refused_as_accelerate_would_offload_it():
    from vramplan.truths.max_memory_truth import capped_device_map

    model = load_model("llama-3.1-8b")
    setup = Setup(method="lora", gpus=2, device_map="auto", max_memory="0=2GiB,1=2GiB")
    assert "disk" in capped_device_map(model.config, setup).values()  # the real map offloads
    with pytest.raises(SpecError, match=r"leaves model\.layers\.4 and 30 more modules on no GPU.*not model"):
        estimate(model, setup, load_gpu("rtx-3090"))


def test_each_gpu_matches_the_traced_step_under_the_caps():
    from vramplan.truths.layer_split_trace import traced_rank_peaks
    from vramplan.truths.max_memory_truth import capped_device_map

    model = load_model("llama-3.2-1b")
    setup = Setup(method="lora", seq=512, gpus=2, device_map="auto", max_memory="0=1GiB,1=4GiB")
    truth = traced_rank_peaks(model.config, setup, capped_device_map(model.config, setup))
    est = estimate(model, setup, load_gpu("a100-80gb"))
    assert [len(r.layers) for r in est.per_rank] == [3, 13]  # even is 8 / 8
    for t, e in zip(truth, est.per_rank, strict=True):
        assert e.tensor_peak_bytes == pytest.approx(max(t.values()), rel=0.02)
    fullest = max(est.per_rank, key=lambda r: r.device_total_bytes)
    assert est.device_total_bytes == fullest.device_total_bytes and fullest.rank == 1


@pytest.mark.slow
def test_validate_rows_meet_the_bar():
    """``vramplan validate --knob device_map``'s capped rows (every case): worst |error| <= 5 %."""
    from vramplan.truths.max_memory_truth import max_memory_rows

    rows = max_memory_rows()
    assert {r.truth for r in rows} == {"placement", "trace"} and all(r.knob == "device_map" for r in rows)
    assert all(r.traced_phase == "layers match" for r in rows if r.truth == "placement")
    assert max(abs(r.error) for r in rows) <= 0.05


def test_notes_name_the_caps_and_a_cap_above_the_free_memory():
    model, gpu = load_model("llama-3.1-8b"), load_gpu("rtx-3090")
    bd = estimate(model, Setup(method="lora", gpus=2, device_map="auto", max_memory="0=8GiB,1=30GiB"), gpu)
    notes = " ".join(bd.notes)
    assert "placed under max_memory 0=8GiB,1=30GiB" in notes
    assert "gives GPU 1 more than the" in notes and "GPU 0" not in notes.split("more than the")[0][-20:]
    plain = estimate(model, Setup(method="lora", gpus=2, device_map="auto"), gpu)
    assert "max_memory" not in " ".join(plain.notes)


def test_cli_json_reports_the_capped_gpus():
    args = ["estimate", "llama-3.1-8b", "--method", "lora", "--gpus", "2", "--device-map", "auto", "--gpu",
            "rtx-3090", "--max-memory", "0=8GiB,1=20GiB", "--json"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [len(r["layers"]) for r in data["per_rank"]] == [14, 18]
    assert data["setup"]["max_memory"] == [8 * GiB, 20 * GiB]


# ----------------------------------------------------------------------------------------------
# emitters and readers


def _plan(setup, name="llama-3.2-1b"):
    model, gpu = load_model(name), load_gpu("rtx-3090")
    return Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), model


def test_train_py_passes_the_caps_as_data():
    setup = Setup(method="lora", gpus=2, device_map="auto", max_memory="0=1GiB,1=4GiB")
    plan, model = _plan(setup)
    assert script_plan(plan, model)["max_memory"] == {0: GiB, 1: 4 * GiB}
    tree = ast.parse(train_script(plan, model))
    plan_node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "PLAN")
    assert ast.literal_eval(plan_node.value)["max_memory"] == {0: GiB, 1: 4 * GiB}
    assert "max_memory" not in script_plan(_plan(setup.replace(max_memory=()))[0], model)
    # the mapping train.py hands from_pretrained is what the truth places with (transformers' own
    # _get_device_map, tests above); on a machine without two GPUs train.py loads on one device
    # without it (tests/test_layer_split.py runs that step)
    assert 'if several and PLAN.get("max_memory"):' in train_script(plan, model)


def test_framework_configs_refuse_the_caps():
    from vramplan.emit.frameworks import framework_config

    plan, model = _plan(Setup(method="lora", gpus=2, device_map="auto", max_memory="0=1GiB,1=4GiB", loss="trl"))
    with pytest.raises(SpecError, match="cannot emit trl"):
        framework_config(plan, "trl", model)


def _trl_yaml(tmp_path, kwargs: dict, extra: str = "") -> str:
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\nuse_peft: true\ndtype: bfloat16\n"
                    f"model_init_kwargs: {json.dumps(kwargs)}\n{extra}")
    return path


def test_trl_model_init_kwargs_map_to_the_capped_split(tmp_path):
    from vramplan.readers import read_config

    read = read_config(_trl_yaml(tmp_path, {"device_map": "auto", "max_memory": {"0": "8GiB", "1": "20GiB"}}))
    assert (read.setup.device_map, read.setup.max_memory, read.setup.gpus) == ("auto", (8 * GiB, 20 * GiB), 2)
    read = read_config(_trl_yaml(tmp_path, {"device_map": "auto", "max_memory": {"0": "8GiB", "1": "20GiB"}},
                                 "num_processes: 2\n"))
    assert read.setup.max_memory == () and any(w.field == "model_init_kwargs.max_memory" for w in read.warnings)
    with pytest.raises(SpecError, match="cpu= is accelerate's budget"):
        read_config(_trl_yaml(tmp_path, {"device_map": "auto", "max_memory": {"0": "8GiB", "cpu": "64GiB"}}))


def test_axolotl_max_memory_is_said_not_modelled(tmp_path):
    from vramplan.readers import read_config

    path = tmp_path / "axolotl.yaml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nlora_target_linear: true\n"
                    "micro_batch_size: 1\nsequence_len: 1024\nmax_memory: {0: 8GiB, 1: 20GiB}\n")
    read = read_config(path)
    assert read.setup.max_memory == ()
    assert any(w.field == "max_memory" and "not modelled" in w.why for w in read.warnings)
