"""The gaps the published real-GPU peaks showed (issue 13, item 2), each modelled as a term with
its source: the library version boundaries an estimate states (estimator/stack.py) and the terms
they switch. The published rows themselves are in calibration/published/records.jsonl."""

from __future__ import annotations

import pytest

from vramplan.calibration.published import (
    compare,
    estimate_record,
    load_records,
    resolve_model,
    step_intercepts,
    token_slopes,
)
from vramplan.estimator import estimate
from vramplan.estimator.distributed import StepActivations
from vramplan.estimator.fsdp import fsdp_memory, fsdp_phase_peaks
from vramplan.estimator.stack import (
    DEFAULT_STACK,
    MODELLED_VERSIONS,
    Stack,
    moe_experts_4x_saving_bytes,
    stack_from_versions,
)
from vramplan.model.profiles import load_model
from vramplan.specs import Setup
from vramplan.util.units import bnb_4bit_tensor_bytes

MISTRAL = "mistralai/Mistral-7B-v0.1"


@pytest.mark.parametrize("version, shift, linear_experts", [
    ("4.45.2", False, True), ("4.46.0", True, True), ("4.48.1", True, True), ("4.49.0", False, True),
    ("5", False, False), ("5.24.0", False, False),
])
def test_transformers_version_boundaries(version, shift, linear_experts):
    """4.46-4.48's ForCausalLMLoss copies the shifted fp32 logits; 4.49 pads the labels instead
    (read off the wheels); 4.x experts are nn.Linear, 5's are fused 3-D parameters."""
    stack = Stack(transformers=version)
    assert stack.loss_shift_copy is shift
    assert stack.moe_experts_linear is linear_experts
    assert stack.is_default is (version.split(".")[0] == "5")


def test_a_stack_is_read_from_a_records_versions():
    assert stack_from_versions({"transformers": {"version": "4.48.1", "how": "stated"}}) == Stack("4.48.1")
    assert stack_from_versions({}) == DEFAULT_STACK
    assert stack_from_versions({"transformers": {"version": "unknown"}}) == DEFAULT_STACK
    with pytest.raises(ValueError):
        Stack(transformers="main")


def test_the_shifted_logits_copy_is_b_s_minus_1_v_fp32_at_the_forward_loss():
    model, setup = resolve_model(MISTRAL), Setup(method="lora", checkpointing=True, batch=4, seq=4096)
    five, four = estimate(model, setup), estimate(model, setup, stack=Stack("4.48.1"))
    copy = 4 * setup.batch * (setup.seq - 1) * model.vocab_size
    assert four.phase == "forward"
    assert four.phase_peaks_bytes["forward"] - five.phase_peaks_bytes["forward"] == copy
    # the backward peaks at the loss, before the recomputed layer that keeps 4.48.1's repeated K/V
    assert four.phase_peaks_bytes["backward"] == five.phase_peaks_bytes["backward"]
    assert any("models transformers 4.48.1" in n and "shifted fp32 logits" in n and "repeat_kv" in n
               for n in four.notes)
    assert not any(n.startswith("models transformers") for n in five.notes)


@pytest.mark.parametrize("version, repeats", [("4.48.1", True), ("4.53.0", True), ("4.54.0", False), ("5", False)])
def test_before_454_sdpa_keeps_k_and_v_repeated_to_every_head(version, repeats):
    """transformers before 4.54 calls SDPA with K/V repeated to every query head (repeat_kv, read off the 4.48.1 and
    4.53.0 wheels); 4.54.0 passes enable_gqa=True when no mask is given. A GQA layer without checkpointing then
    keeps 2 c (q - kv) bytes a token more; an MHA model and FlashAttention-2 nothing. Verified on the real 4.48.1
    step (calibration/published/moe_4x_probe.py: the GQA Mixtral rows without checkpointing -2.7 / -2.1 / -0.7 %
    -> -0.8 / -0.6 / -0.3 %, where MHA runs gave the latter; the same probe's base loader on narrow dense Llama-3.1
    (8/2 heads) and Qwen2.5 (8/1) LoRA steps, batch 2 x 256: without checkpointing -2.4 / -2.3 % -> -0.5 / -0.4 %,
    with it Qwen2.5 -2.2 -> -0.5 %, Llama -0.9 % either way)."""
    model, setup = resolve_model(MISTRAL), Setup(method="lora", seq=1024)
    stack = Stack(version)
    assert stack.sdpa_repeats_kv is repeats
    gap = estimate(model, setup, stack=stack).tensor_peak_bytes - estimate(model, setup).tensor_peak_bytes
    layers = model.num_layers * 2 * 2 * (model.q_dim - model.kv_dim) * setup.tokens  # bf16 K and V
    loss = 4 * setup.batch * (setup.seq - 1) * model.vocab_size if stack.loss_shift_copy and setup.batch > 1 else 0
    assert gap == (layers if repeats else 0) + loss
    assert (estimate(model, setup.replace(attn="flash"), stack=stack).tensor_peak_bytes
            == estimate(model, setup.replace(attn="flash")).tensor_peak_bytes)
    gpt2 = resolve_model("gpt2")  # MHA: nothing repeated
    assert estimate(gpt2, setup, stack=stack).tensor_peak_bytes == estimate(gpt2, setup).tensor_peak_bytes


def test_at_micro_batch_one_the_shifted_slice_is_contiguous_and_not_copied():
    """``logits[..., :-1, :]`` of a [1, s, V] tensor is contiguous, so 4.46-4.48's ``.contiguous()``
    returns it as is (the 4.48.1 loss on the CPU counter: +321,260 B/token at batch 1, +450,992
    at batch 2, vocab 32000): the forward equals transformers 5's."""
    model = resolve_model(MISTRAL)
    one, two = (Setup(method="lora", checkpointing=True, batch=b, seq=4096) for b in (1, 2))
    four = Stack("4.48.1")
    assert estimate(model, one, stack=four).phase_peaks_bytes == estimate(model, one).phase_peaks_bytes
    forward = [estimate(model, two, stack=s).phase_peaks_bytes["forward"] for s in (four, DEFAULT_STACK)]
    assert forward[0] - forward[1] == 4 * 2 * 4095 * model.vocab_size


def test_the_default_stack_states_the_versions_it_models():
    assert Stack().describe().startswith("transformers 5, torch 2.13")
    assert set(MODELLED_VERSIONS) >= {"transformers", "torch", "peft", "accelerate", "bitsandbytes", "flash-attn"}


EXACT_MISTRAL_LORA = ["fms-a100_80gb-16-Mistral-7B-v0.1-lora-g1-bs4", "fms-a100_80gb-csv34-Mistral-7B-v0.1-lora-g1-bs8"]


@pytest.mark.parametrize("rid", EXACT_MISTRAL_LORA)
def test_mistral_lora_one_gpu_rows_within_one_percent_under_their_transformers(rid):
    """fms-acceleration's Mistral-7B LoRA rows (transformers 4.48.1, exact lengths, every knob
    expressible): the shifted-logits copy was the whole -4 % / -6 % gap."""
    (record,) = [r for r in load_records() if r["id"] == rid]
    assert record["comparable"] and not record["approximations"]
    measured = record["measured_bytes"]
    assert abs(estimate_record(record).peak_allocated_bytes / measured - 1) < 0.01
    five = estimate(resolve_model(record["model"]), Setup.from_dict(record["setup"]))
    assert five.peak_allocated_bytes / measured - 1 < -0.03  # the stack is what closes it


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantized_moe_states_what_transformers_4_would_take(quant):
    spec = load_model("mixtral-8x7b")
    setup = Setup(method="lora", quant=quant)
    saving = moe_experts_4x_saving_bytes(spec, setup)
    experts = sum(n for name, n in spec.other_params if name == "experts")
    tensors = 3 * spec.moe.num_experts * spec.moe.num_moe_layers
    if quant == "nf4":
        assert saving == 4 * experts - tensors * bnb_4bit_tensor_bytes(experts // tensors, True)
    assert 0 < saving < 4 * experts
    five = estimate(spec, setup)
    assert any("under transformers 4.x" in n and f"{saving / 2**30:.1f} GiB less" in n for n in five.notes)
    four = estimate(spec, setup, stack=Stack("4.48.1"))
    assert any("per-expert nn.Linear (quantized by bitsandbytes" in n for n in four.notes)  # estimator/moe_4x.py
    assert moe_experts_4x_saving_bytes(spec, Setup(method="lora")) == 0
    assert moe_experts_4x_saving_bytes(load_model("llama-3.1-8b"), setup) == 0


FSDP_LORA_PAIR = ("fms-a100_80gb-17-Mistral-7B-v0.1-lora-g2-bs2", "fms-a100_80gb-19-Mistral-7B-v0.1-lora-g2-bs4")
ONE_GPU_LORA_PAIR = tuple(EXACT_MISTRAL_LORA)


def _allocated_slope(ids):
    records = load_records()
    rows = [r for r in compare([r for r in records if r["id"] in ids]) if r.quantity == "allocated"]
    (slope,) = token_slopes(records, rows)
    assert slope.ids == ids
    return slope


def test_one_gpu_mistral_lora_per_token_slope_within_one_percent():
    """What one more token costs on one GPU (bs4 -> bs8, fms-acceleration, transformers 4.48.1):
    734,762 B measured, within 1 % estimated: the per-token terms of the single-GPU step hold."""
    slope = _allocated_slope(ONE_GPU_LORA_PAIR)
    assert abs(slope.error) < 0.01


def test_fsdp_mistral_lora_per_token_slope_within_one_percent():
    """On 2 GPUs under FSDP1 with reentrant checkpointing (transformers 4.48.1's default) the LoRA
    step costs 831,904 B per token measured, ~97 KB more than on one GPU: the peak is the bottom
    layer's backward (root + one layer unit gathered: the intercept test below), where FSDP's
    reshard-only hook has kept 2L - 3 layer inputs more than one process holds
    (estimator/fsdp.py ``fsdp_phase_peaks``): 832,863 B estimated (+0.1 %)."""
    slope = _allocated_slope(FSDP_LORA_PAIR)
    assert slope.phases == ("backward", "backward")
    assert abs(slope.error) < 0.01


def test_moe_lora_off_the_experts_builds_no_merged_expert_copy():
    """LoRA on q/k/v/o of Mixtral: peft 0.21 wraps no 3-D expert parameter (no ParamWrapper), so no
    merged copy of the expert stack exists; with all-linear it does. The fake-tensor trace of the
    real step agrees to the MiB at seq 1024 and 2048 (87.86 / 88.57 GiB: `vramplan trace
    mixtral-8x7b --method lora --lora-targets q_proj,k_proj,v_proj,o_proj --checkpointing --seq
    1024`); fms-acceleration's 2-GPU Mixtral LoRA rows moved from +6.7 / +9.5 % to +0.9 / +3.0 %."""
    from vramplan.estimator.activations import moe_lora_weight_bytes

    spec = load_model("mixtral-8x7b")
    attention = Setup(method="lora", lora_targets="q_proj,k_proj,v_proj,o_proj", checkpointing=True)
    assert moe_lora_weight_bytes(spec, attention) == 0
    assert moe_lora_weight_bytes(spec, Setup(method="lora", checkpointing=True)) > 0
    est = estimate(spec, attention)
    assert est.component("recompute") < 2**30 * (attention.tokens / 2048)  # no 2.6 GiB expert stack per layer


@pytest.mark.parametrize("version, reentrant", [("4.35.0", True), ("4.48.1", True), ("5", False), ("5.24.0", False)])
def test_the_trainers_default_checkpointing_is_reentrant_under_transformers_4(version, reentrant):
    """4.48.1 ``gradient_checkpointing_enable``: ``{"use_reentrant": True}``; 5.24
    ``_activation_checkpointing_enable``: ``{"use_reentrant": False}`` (read off the wheels)."""
    assert Stack(transformers=version).reentrant_checkpointing is reentrant


def test_without_backward_prefetch_fsdp1_holds_one_layer_unit_fewer_where_two_were_gathered():
    model = resolve_model(MISTRAL)
    setup = Setup(method="lora", checkpointing=True, batch=1, seq=16, gpus=2, fsdp="full_shard")
    fm = fsdp_memory(model, setup)
    # the top layer's moment dominates: two units gathered with the prefetch, one without
    act = StepActivations(at_loss=1, backward_start=1, top_layer=2**30, bottom_layer=1, end=1, saved=1)
    with_, without = (fsdp_phase_peaks(model, setup, fm, act, reentrant=r) for r in (False, True))
    assert with_["backward"] - without["backward"] == fm.layer > 0
    assert with_["forward"] == without["forward"] and with_["optimizer"] == without["optimizer"]
    # at the start of the backward the prefetched unit is the only difference too
    act = StepActivations(at_loss=1, backward_start=2**30, top_layer=1, bottom_layer=1, end=1, saved=1)
    with_, without = (fsdp_phase_peaks(model, setup, fm, act, reentrant=r) for r in (False, True))
    assert with_["backward"] - without["backward"] == fm.layer


def test_a_transformers_4_estimate_under_fsdp1_and_checkpointing_is_reentrant():
    """The 4.x stack's reentrant default reaches the FSDP1 estimate (at batch 1, where 4.48's loss
    equals 5's) through fsdp_phase_peaks; without checkpointing, or with one GPU, the stacks agree.
    On 2 gloo ranks with transformers 4.48.1/peft 0.13.2/accelerate 1.0.1 over torch 2.13
    (fsdp_trainer_probe.py, H 1024, I 3584, 4 layers, 8/2 heads, vocab 32000, LoRA q/k/v/o, seq 256,
    batch 1) the backward peak is 355,040,540 B reentrant and 382,307,612 B with
    ``use_reentrant: False``: estimated 355,284,992 (+0.07 %) and 382,552,064 (+0.06 %)."""
    model = resolve_model(MISTRAL)
    four = Stack("4.48.1")
    setup = Setup(method="lora", checkpointing=True, batch=1, seq=16, gpus=2, fsdp="full_shard")
    a, b = estimate(model, setup, stack=four), estimate(model, setup)
    assert a.phase_peaks_bytes["forward"] == b.phase_peaks_bytes["forward"]
    assert a.phase_peaks_bytes["backward"] != b.phase_peaks_bytes["backward"]
    assert any("reentrant checkpointing: FSDP1 prefetches no layer unit" in n for n in a.notes)
    assert a.phase_peaks_bytes["forward"] == b.phase_peaks_bytes["forward"]
    # (FlashAttention-2: no repeated K/V on either side of 4.54, test_before_454_sdpa_keeps_k_and_v_repeated...)
    for other in (Setup(method="lora", checkpointing=False, batch=1, seq=16, gpus=2, fsdp="full_shard", attn="flash"),
                  Setup(method="lora", checkpointing=True, batch=1, seq=16, attn="flash")):
        assert estimate(model, other, stack=four).phase_peaks_bytes == estimate(model, other).phase_peaks_bytes
        assert not any("reentrant" in n for n in estimate(model, other, stack=four).notes)


def test_reentrant_frozen_layer_units_keep_2l_minus_3_layer_inputs_at_the_bottom_layer():
    """Under reentrant checkpointing a frozen layer unit's reshard-only hook holds each recomputed
    layer's input (the checkpoint) and its gradient to the end of the backward: at the bottom
    layer's backward 2L - 3 layer inputs (``act.end`` bytes each) more, at the end 2L - 1; a full
    fine-tune's units train (no such hook) and nothing is added. 2-rank CPU truth
    (fsdp_trainer_probe.py, transformers 4.48.1 over torch 2.13, H 1024, I 3584, 8 layers, vocab
    256, LoRA, seq 256, batch 1 -> 2): live bytes per token at each layer's recompute, one process
    18,464 at the top falling 2,048 per layer to 4,128 at the bottom; FSDP 18,464, 18,464, then
    rising 2,048 per layer to 30,752 = 4,128 + (2 x 8 - 3) x 2,048; the backward peak slope
    differs by 12,288 B/token measured and estimated."""
    model = resolve_model(MISTRAL)
    L = model.num_layers
    act = StepActivations(at_loss=1, backward_start=1, top_layer=1, bottom_layer=2**30, end=2**20, saved=1)
    for method, leaks in (("lora", True), ("qlora", True), ("full", False)):
        setup = Setup(method=method, checkpointing=True, batch=1, seq=16, gpus=2, fsdp="full_shard",
                      quant="nf4" if method == "qlora" else "none")
        fm = fsdp_memory(model, setup)
        plain, reentrant = (fsdp_phase_peaks(model, setup, fm, act, reentrant=r)["backward"] for r in (False, True))
        assert reentrant - plain == ((2 * L - 3) * act.end if leaks else 0), method


def test_torch_multi_grad_hook_keeps_a_leaf_and_its_grad_until_removed():
    """The torch behaviour the term rests on (torch/autograd/graph.py ``register_multi_grad_hook``,
    2.13; the same ``grad_fns = list(map(_get_grad_fn_or_grad_acc, tensors))`` closure in the
    2.2-2.5 sources): the closure holds the leaf's AccumulateGrad, which holds the leaf, so neither
    the leaf nor its ``.grad`` is freed, not even by the garbage collector, until the handle is
    removed (FSDP1: ``_finalize_params`` at the end of the backward). Fails, and so flags the term
    for removal, if a torch release breaks the cycle."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    from torch.autograd.graph import register_multi_grad_hook

    leaf = torch.zeros(8, requires_grad=True)
    handle = register_multi_grad_hook([leaf], lambda grads: None)
    (leaf * 2).sum().backward()
    alive, grad = weakref.ref(leaf), weakref.ref(leaf.grad)
    del leaf
    gc.collect()
    assert alive() is not None and grad() is not None
    handle.remove()
    gc.collect()
    assert alive() is None and grad() is None
    plain = torch.zeros(8, requires_grad=True)
    plain.register_hook(lambda g: None)
    gone = weakref.ref(plain)
    del plain
    assert gone() is None


FSDP_PAIRS = [FSDP_LORA_PAIR,
              ("fms-a100_80gb-29-Mistral-7B-v0.1-qlora-g2-bs2", "fms-a100_80gb-31-Mistral-7B-v0.1-qlora-g2-bs4"),
              ("fms-a100_80gb-21-Mixtral-8x7B-Instruct-v0.1-lora-g2-bs2",
               "fms-a100_80gb-23-Mixtral-8x7B-Instruct-v0.1-lora-g2-bs4")]


def test_published_fsdp_lora_peaks_hold_the_root_and_exactly_one_layer_unit():
    """fms-acceleration's 2-GPU FSDP1 LoRA/QLoRA pairs (reentrant checkpointing, BACKWARD_PRE):
    peak - allocation after training - slope x tokens is the root unit plus ONE layer unit,
    unsharded (Mistral LoRA +1.3 MiB, QLoRA +1.2, Mixtral +1.8), not two (the prefetch: -416 MiB,
    -104, -2768) nor the root alone; on one GPU it is 0 (+1.7 MiB). So the FSDP peak is a decoder
    layer's backward: the bottom layer's, where the reentrant term peaks (fsdp_phase_peaks)."""
    records = load_records()
    rows = [r for r in compare(records) if r.quantity == "allocated"]
    by_ids = {i.ids: i for i in step_intercepts(records, token_slopes(records, rows))}
    for ids in FSDP_PAIRS:
        i = by_ids[ids]
        assert i.fsdp == "full_shard" and i.layer_bytes > 100 * 2**20
        assert abs(i.excess_bytes) < 4 * 2**20, (ids, i.excess_bytes)
    one = by_ids[ONE_GPU_LORA_PAIR]
    assert one.one_layer_bytes == 0 and abs(one.measured_bytes) < 4 * 2**20


def test_the_issue_13_bars_hold_on_the_comparable_published_rows():
    """Issue 13's bars on the comparable rows, estimated as `vramplan validate --published` does
    (the committed calibration): median |error| <= 3 %, p90 <= 10 %, under-estimated by more than
    3 % on <= 10 % of rows; on the 15 allocated rows and on all 28 (their nvidia-smi numbers too), the two
    Mixtral QLoRA device totals held apart (below). Before those rows: all 26 rows median 2.0 %, p90 9.9 %,
    2 under (the device totals of the two 2-GPU Mistral-7B full fine-tunes)."""
    from vramplan.calibration.published import summarize
    from vramplan.estimator.corrections import calibration_for
    from vramplan.model.profiles import load_gpu

    def estimator(r):
        return estimate_record(r, calibration_for(load_gpu(r["gpu"]))[0])

    records = load_records()
    # issue 13's rows: the A100 sources; the consumer cards' reserved-only rows (issue 28, Answer.AI's
    # fsdp_qlora) are what their class's device terms are fitted on, checked below against that fit
    consumer = [r for r in records if r["source"]["repo"] == "AnswerDotAI/fsdp_qlora"]
    rows = compare([r for r in records if r not in consumer], estimator=estimator)
    # the 2-GPU Mixtral QLoRA rows (comparable since estimator/moe_4x.py models transformers 4.48.1's per-expert
    # Linears): allocated within 0.5 %, but nvidia-smi above the A100 class's device terms (fitted on dense runs:
    # +6.3 % + 4.3 GiB) by 10.0 % at micro-batch 2 and 3.4 % at 4 -- a known gap (an MoE's many small quantized
    # tensors under FSDP; not fitted apart on two rows), held here so it cannot grow unnoticed
    moe_smi = [r for r in rows if "Mixtral" in r.id and "qlora" in r.id and r.quantity == "device_total"]
    assert len(moe_smi) == 2 and all(-0.11 <= r.error <= 0 for r in moe_smi), moe_smi
    summary = {(s.group, s.key): s for s in summarize([r for r in rows if r not in moe_smi])}
    for key in (("quantity", "allocated"), ("all", "all")):
        s = summary[key]
        assert s.median_abs_error <= 0.03 and s.p90_abs_error <= 0.10 and s.under_share <= 0.10, (key, s)
    # (+2 allocated, +2 device totals in all: the Mixtral QLoRA rows above)
    assert summary[("quantity", "allocated")].rows == 15 and summary[("all", "all")].rows == 28
    # the RTX 3090/4090 reserved peaks against their calibrated estimates: inside the fitted bands
    # (in-sample, reserved: sm86 -10.7 % / +15.1 % over 13 rows, sm89 -11.3 % / +19.6 % over 11), median
    # |error| 4.0 %; 24 rows since the catalogue's Yi-34B and Mistral-7B-v0.2 configs made 6 more comparable
    (mine,) = [s for s in summarize(compare(consumer, estimator=estimator)) if s.group == "all"]
    assert mine.rows == 24 and mine.median_abs_error <= 0.06 and abs(mine.worst_error) <= 0.17, mine
