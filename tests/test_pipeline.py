"""Pipeline parallelism (``--pp N``, estimator/pipeline.py) against torch 2.13's own
``torch.distributed.pipelining`` schedules (vramplan/truths/pipeline.py): the setup's refusals, the
stage split, the schedules' in-flight micro-batches against torch's own action lists, one row per
stage, and the real schedule on gloo ranks per stage."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_model
from vramplan.cli import main as cli
from vramplan.estimator.pipeline import actions, in_flight_peak, stage_layers
from vramplan.specs import SpecError

PP2 = {"pp": 2, "gpus": 2}


def test_cli_pp_with_zero3_is_one_error_line_naming_the_engine_and_what_runs():
    """The issue's done-when: DeepSpeed's pipeline engine asserts ZeRO-2/3 away (engine.py:76)."""
    from cli_helpers import assert_user_error

    r = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", "--gpu", "a100-80gb", "--gpus", "4", "--tp", "2",
                                 "--pp", "2", "--zero", "3"])
    line = assert_user_error(r, "pipeline parallelism", "ZeRO-3", "runtime/pipe/engine.py:76", "instead")
    assert "ZeRO-0/1" in line and "--zero 0" in line
    assert "torchtitan" in line and "--fsdp full_shard --fsdp-version 2" in line  # what is modelled instead


def test_deepspeed_asserts_what_the_refusal_cites():
    """The cited assert is where the refusal says it is (deepspeed 0.19.8 runtime/pipe/engine.py:76)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed not installed")
    lines = (Path(spec.origin).parent / "runtime" / "pipe" / "engine.py").read_text().splitlines()
    assert "ZeroStageEnum.gradients" in lines[76] and "incompatible with pipeline parallelism" in lines[76]


@pytest.mark.parametrize("kw, why", [
    ({"pp": 2, "gpus": 2, "zero_stage": 2}, "ZeRO-2 and ZeRO-3 are incompatible"),
    ({"pp": 2, "gpus": 2, "grad_accum": 1}, "Schedule1F1B needs at least one per stage"),
    ({"pp": 2, "gpus": 2, "grad_accum": 2, "pp_schedule": "interleaved-1f1b"}, "not modelled yet"),
    ({"pp": 2, "gpus": 2, "grad_accum": 2, "pp_schedule": "zbv"}, "not modelled yet"),
    ({"pp_schedule": "gpipe"}, "add --pp 2 or more"),
    ({"pp": 2, "gpus": 3, "grad_accum": 2}, "multiple of pp"),
])
def test_setup_refuses_in_one_line(kw, why):
    with pytest.raises(SpecError, match=why) as exc:
        Setup(**kw)
    assert "\n" not in str(exc.value)


def test_gpipe_runs_any_micro_batch_count():
    assert Setup(**PP2, pp_schedule="gpipe", grad_accum=1).pp_schedule == "gpipe"


@pytest.mark.parametrize("model, kw, why", [
    ("llama-3.1-8b", {"method": "lora", "grad_accum": 2}, "LoRA/QLoRA"),
    ("llama-3.1-8b", {"tp": 2, "gpus": 4, "grad_accum": 2, "fsdp": "full_shard", "fsdp_version": 2},
     "--tp 2 is not modelled yet: torchtitan runs TP inside each pipeline stage"),
    ("llama-3.1-8b", {"tp": 2, "gpus": 4, "grad_accum": 2}, "--tp 2 is not modelled yet"),
    ("llama-3.1-8b", {"gpus": 4, "grad_accum": 2, "fsdp": "full_shard"}, r"--fsdp full_shard \(FSDP1\)"),
    ("llama-3.1-8b", {"grad_accum": 2, "fsdp": "full_shard", "fsdp_version": 2}, "on --gpus 2 is not modelled"),
    ("llama-3.1-8b", {"gpus": 8, "grad_accum": 2, "fsdp": "full_shard", "fsdp_version": 2, "dp_replicate": 2},
     "--dp-replicate"),
    ("llama-3.1-8b", {"gpus": 4, "grad_accum": 2, "zero_stage": 1}, "PipelineEngine"),
    ("llama-3.1-8b", {"grad_accum": 2, "precision": "bf16-mixed"}, "bf16-mixed"),
    ("llama-3.1-8b", {"grad_accum": 2, "zero_stage": 1}, "--zero 1"),
    ("llama-3.2-1b", {"grad_accum": 2}, "tied input and output embeddings"),
    ("Qwen/Qwen3-30B-A3B", {"grad_accum": 2}, "not modelled yet"),
])
def test_estimate_refuses_what_the_truth_does_not_run(model, kw, why):
    setup = Setup(**{"pp": 2, "gpus": 2, **kw})
    with pytest.raises(SpecError, match=why):
        estimate(load_model(model), setup)


def test_stage_split_is_even_and_covers_every_layer():
    for layers in (4, 5, 32, 80, 81):
        for p in (2, 3, 4, 8):
            if p > layers:
                continue
            split = [stage_layers(layers, p, r) for r in range(p)]
            assert [i for s in split for i in s] == list(range(layers))
            assert max(map(len, split)) - min(map(len, split)) <= 1
            assert len(split[-1]) == layers // p  # the last stage (head, loss) is never the longer one


@pytest.mark.parametrize("p, n", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_in_flight_micro_batches_are_torchs(p, n):
    """The replayed action lists keep as many micro-batches in flight as torch 2.13's own schedule IR
    (``_get_pipeline_order``) does: GPipe all n; 1F1B min(n, p - r) at stage r."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _ComputationType

    fake = SimpleNamespace(_num_stages=p, _n_microbatches=n)
    for schedule, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        order = cls._get_pipeline_order(fake)
        for r in range(p):
            live = most = 0
            for a in order[r]:
                if a is None or a.computation_type not in (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD):
                    continue
                live += 1 if a.computation_type == _ComputationType.FORWARD else -1
                most = max(most, live)
            assert in_flight_peak(schedule, p, r, n) == most == (n if schedule == "gpipe" else min(n, p - r))
            assert sorted(actions(schedule, p, r, n)) == sorted([("F", i) for i in range(n)] + [("B", i)
                                                                                             for i in range(n)])


def test_cli_estimate_pp_json_gives_one_row_per_stage_that_differ_as_the_schedule_says():
    """The issue's 70B example on one pipeline of 4 (with data parallelism beside it: the test below)."""
    args = ["estimate", "llama-3.1-70b", "--gpu", "a100-80gb", "--gpus", "4", "--pp", "4", "--grad-accum", "8",
            "--method", "full", "--json"]
    rows = {}
    for schedule in ("1f1b", "gpipe"):
        r = CliRunner().invoke(cli, [*args, "--pp-schedule", schedule])
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        assert [x["rank"] for x in got["per_rank"]] == [0, 1, 2, 3]
        assert [len(x["layers"]) for x in got["per_rank"]] == [20, 20, 20, 20]
        fullest = max(got["per_rank"], key=lambda x: (x["device_total_bytes"], -x["rank"]))
        assert got["fullest_stage"] == fullest["rank"] and got["device_total_bytes"] == fullest["device_total_bytes"]
        assert any(f"stage {fullest['rank']}'s, the fullest" in n for n in got["notes"])
        rows[schedule] = [x["tensor_peak_bytes"] for x in got["per_rank"]]
    one, gp = rows["1f1b"], rows["gpipe"]
    assert one[0] > one[1] > one[2]  # 4, 3, 2 micro-batches in flight on the same layers
    assert all(g > o for g, o in zip(gp[:3], one[:3], strict=True))  # GPipe keeps all 8
    r = CliRunner().invoke(cli, args[:-1] + ["--pp-schedule", "1f1b"])
    assert r.exit_code == 0 and "per stage" in r.stdout and "the fullest stage's, stage" in r.stdout


def test_stage_states_add_up_to_the_model():
    from vramplan.estimator.pipeline import stage_model

    model = load_model("llama-3.1-8b")
    setup = Setup(pp=4, gpus=4, grad_accum=4)
    assert sum(stage_model(model, setup, r).params_total for r in range(4)) == model.params_total


def test_truth_two_ranks_meets_the_bar():  # the PP truth at its smallest shape: the fast tier
    from vramplan.truths.pipeline import pp_rows

    rows = [r for r in pp_rows(quick=True) if r.verified]
    assert len(rows) == 4  # 1f1b and gpipe, two stages each
    for row in rows:
        assert abs(row.error) <= 0.05, (row.model, row.setup.pp_schedule, row.error)


@pytest.mark.slow
def test_truth_matrix_meets_the_bar():
    """Both schedules on 2 and 4 gloo ranks, checkpointing, accumulation, batch 2: each stage within 5 %
    (one pipeline; with data parallelism beside it: test_truth_beside_data_parallelism_meets_the_bar)."""
    from vramplan.truths.pipeline import pp_rows

    rows = pp_rows(quick=False, dp=False)
    assert all(r.verified for r in rows), [r.why for r in rows if not r.verified]
    assert {r.truth for r in rows} == {"pp-2", "pp-4"}
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.05, (worst.model, worst.setup, worst.error)


@pytest.mark.slow
def test_truth_beside_data_parallelism_meets_the_bar():
    """pp 2 x dp 2 on 4 gloo ranks: DDP and FSDP2 (torchtitan's wrapping) around each real pipeline stage,
    both schedules, checkpointing, a wide vocabulary, fp32, batch 2: each stage within 5 % (~40 s)."""
    from vramplan.truths.pipeline import pp_rows

    rows = pp_rows(quick=False, dp=True)
    assert all(r.verified for r in rows), [r.why for r in rows if not r.verified]
    assert {r.truth for r in rows} == {"pp-4"} and len(rows) == 22
    assert {" x ddp 2" in r.model for r in rows} == {True, False}  # both DDP and FSDP2 rows
    assert {r.setup.fsdp for r in rows} == {"none", "full_shard", "shard_grad_op"}
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.05, (worst.model, worst.setup, worst.error)


@pytest.mark.parametrize("p, dp", [(2, 2), (4, 2), (2, 4), (3, 3)])
def test_fsdp2_stage_groups_cover_the_stage_and_shard_it(p, dp):
    """torchtitan's groups per stage (embedding, layers, norm + head) hold exactly the stage's parameters;
    each rank's weights are the padded shards: at least 1/dp of the stage, never more than a row per
    parameter above it."""
    import math

    from vramplan.estimator.pipeline import stage_groups, stage_model, stage_terms

    model = load_model("llama-3.1-8b")
    setup = Setup(pp=p, gpus=p * dp, grad_accum=p, fsdp="full_shard", fsdp_version=2)
    for r in range(p):
        groups = stage_groups(model, setup, r)
        part = stage_model(model, setup, r)
        assert sum(math.prod(t) for g in groups for t in g) == part.params_total
        t = stage_terms(model, setup, r)
        assert part.params_total * 2 / dp <= t.weights <= part.params_total * 2 / dp + 2 * sum(
            math.prod(x[1:]) for g in groups for x in g)
        assert t.unsharded == dp * t.weights and t.gradients == part.params_total * 2 and t.grad_after == t.weights
        assert t.optimizer_states == pytest.approx(2 * t.weights, rel=1e-9)


def test_data_parallelism_beside_the_pipeline_changes_what_it_should():
    """DDP adds its buckets (one gradient copy) and nothing else to a stage; FSDP2 shards the weights and
    states but keeps the stage gathered and its gradients unsharded through the micro-batches."""
    from vramplan.estimator.pipeline import stage_terms

    model = load_model("llama-3.1-8b")
    alone = Setup(pp=4, gpus=4, grad_accum=8, seq=1024)
    ddp = Setup(pp=4, gpus=8, grad_accum=8, seq=1024)
    fsdp2 = Setup(pp=4, gpus=8, grad_accum=8, seq=1024, fsdp="full_shard", fsdp_version=2)
    one, two, three = (estimate(model, s) for s in (alone, ddp, fsdp2))
    for r in range(4):
        t = stage_terms(model, alone, r)
        assert two.per_rank[r].tensor_peak_bytes == one.per_rank[r].tensor_peak_bytes + t.gradients
        assert three.per_rank[r].tensor_peak_bytes < two.per_rank[r].tensor_peak_bytes
        # the gathered parameters and unsharded gradients are there: more than half the DDP stage's states
        assert three.per_rank[r].tensor_peak_bytes > one.per_rank[r].tensor_peak_bytes - t.optimizer_states
    assert two.component("ddp_buckets") and three.component("fsdp2_unsharded") and three.component("grad_shards")
    assert any("beside it DDP over 2 replicas" in n for n in two.notes)
    assert any("FSDP2 over 2 ranks per stage as torchtitan" in n for n in three.notes)


def test_cli_estimate_pp_with_data_parallelism_answers_per_stage():
    """The issue's done-when: 70B, 8 GPUs, pp 4 x dp 2 (DDP, and FSDP2 as torchtitan runs it): four rows
    that differ as 1F1B says, the fullest named."""
    args = ["estimate", "llama-3.1-70b", "--gpu", "a100-80gb", "--gpus", "8", "--pp", "4", "--pp-schedule", "1f1b",
            "--grad-accum", "8", "--method", "full", "--json"]
    for extra in ([], ["--fsdp", "full_shard", "--fsdp-version", "2"]):
        r = CliRunner().invoke(cli, [*args, *extra])
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        rows = got["per_rank"]
        assert [x["rank"] for x in rows] == [0, 1, 2, 3] and [len(x["layers"]) for x in rows] == [20] * 4
        peaks = [x["tensor_peak_bytes"] for x in rows]
        assert len(set(peaks)) == 4 and peaks[0] == max(peaks)  # stage 0 holds 4 micro-batches, stage 3 one
        assert got["fullest_stage"] == 0 and got["device_total_bytes"] == rows[0]["device_total_bytes"]


def test_a_pipeline_plan_is_neither_emitted_nor_measured(tmp_path):
    """No emitted config runs a schedule yet: emit and measure refuse --pp in one line, never run it without."""
    from cli_helpers import assert_user_error
    from click.testing import CliRunner

    from vramplan.calibration.measure import check_measurable
    from vramplan.cli import main
    from vramplan.emit import render
    from vramplan.estimator import estimate as estimate_of
    from vramplan.model.profiles import load_gpu as gpu_of
    from vramplan.model.profiles import load_model as model_of
    from vramplan.specs import Plan
    from vramplan.specs import Setup as S
    from vramplan.util.errors import SpecError as Err

    setup = S(method="full", pp=2, gpus=2, grad_accum=2, pp_schedule="1f1b")
    m, g = model_of("llama-3.1-8b"), gpu_of("a100-80gb")  # untied: torch's stages sync no tied weights
    bd = estimate_of(m, setup, g)
    plan = Plan(model=m.name, setup=setup, breakdown=bd, gpu=g)
    with pytest.raises(Err, match="pipeline-parallel plan"):
        render(plan, model=m)
    with pytest.raises(Err, match="--pp 2 cannot be measured"):
        check_measurable(setup)
    assert_user_error(CliRunner().invoke(main, ["measure", "llama-3.1-8b", "--method", "full", "--pp", "2",
                                                "--gpus", "2", "--grad-accum", "2"]), "--pp")
