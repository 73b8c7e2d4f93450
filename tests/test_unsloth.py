"""--framework unsloth (estimator/unsloth.py): Unsloth's preparation, offloaded checkpointing, fused
cross-entropy and fused LoRA layer, read from unsloth 2026.8.19 / unsloth-zoo 2026.8.13. Unsloth imports
only with a GPU: these check the terms against the source's arithmetic and Unsloth's own published
context-length table, not against a CPU run."""

from __future__ import annotations

import math

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan import estimate, plan
from vramplan.cli import main
from vramplan.estimator import unsloth
from vramplan.model.profiles import load_model
from vramplan.search.rank import residency
from vramplan.specs import GpuSpec, Setup
from vramplan.util.errors import SpecError
from vramplan.util.units import GiB


def run(*args: str):
    return CliRunner().invoke(main, list(args))

LLAMA = load_model("llama-3.1-8b")


def _setup(**kw) -> Setup:
    base = dict(method="qlora", checkpointing=True, seq=4096, batch=1, optimizer="adamw-8bit")
    return Setup(**{**base, **kw})


def _unsloth(**kw) -> Setup:
    return _setup(framework="unsloth", loss="unsloth", **kw)


def test_the_loss_and_the_framework_go_together():
    with pytest.raises(SpecError, match="loss 'unsloth'"):
        Setup(framework="unsloth")
    with pytest.raises(SpecError, match="loss 'unsloth'"):
        Setup(loss="unsloth")
    assert _unsloth().framework == "unsloth"


def test_chunks_follow_get_chunk_size():
    """unsloth_zoo get_chunk_size: n = ceil(fp32 logits / target / 4) * 4, 1 when they fit the target."""
    V = LLAMA.vocab_size
    assert unsloth.chunks(LLAMA, _unsloth(seq=2048)) == 1  # 0.98 GiB of fp32 logits < 4 GiB
    assert unsloth.chunks(LLAMA, _unsloth(seq=32768)) == 4  # 15.7 GiB / 4 GiB = 3.9 -> 4
    free = 6 * GiB  # target min(3 GiB, 4 GiB)
    exact = 32768 * V * 4 / (3 * GiB)
    assert unsloth.chunks(LLAMA, _unsloth(seq=32768), free) == math.ceil(exact / 4) * 4 == 8


def test_only_the_last_layer_input_and_two_buffers_stay_on_the_device():
    s = _unsloth(seq=8192)
    bd = estimate(LLAMA, s)
    layer_input = 8192 * LLAMA.hidden_size * 2
    assert bd.component("checkpointed_inputs") == 3 * layer_input
    assert bd.component("checkpoint_offload_host") == (LLAMA.num_layers - 1) * layer_input
    short = estimate(LLAMA, _unsloth(seq=256))  # below max_seq_length 512: plain checkpointing
    assert short.component("checkpointed_inputs") == LLAMA.num_layers * 256 * LLAMA.hidden_size * 2
    assert short.component("checkpoint_offload_host") == 0


def test_no_upcast_fp32_adapters_and_the_dequantization_buffer():
    un, trl = estimate(LLAMA, _unsloth()), estimate(LLAMA, _setup(framework="trl", loss="trl"))
    hf = estimate(LLAMA, _setup())
    assert un.component("weights") == trl.component("weights") < hf.component("weights")
    assert un.component("adapters") == 2 * trl.component("adapters")  # fp32 vs TRL's bf16
    mlp = max(l.weight_params for l in LLAMA.linears if l.role == "mlp")
    assert un.component("dequantization_buffer") == 2 * mlp
    assert "other params bfloat16" in next(c.note for c in un.components if c.name == "weights")


def test_the_fused_loss_holds_a_chunk_not_the_logits():
    s = _unsloth(seq=32768)
    bd = estimate(LLAMA, s, GpuSpec.custom(24 * GiB))
    chunk = 32768 // 4
    assert bd.component("logits_loss") == 2 * 2 * chunk * LLAMA.vocab_size + 2 * 32768 * LLAMA.hidden_size
    assert bd.component("logits_loss") < estimate(LLAMA, _setup(seq=32768)).component("logits_loss") / 3


# Unsloth's README (unslothai/unsloth README.md at e3162dc5bf, 2025-01-14, "Llama 3.1 (8B) max. context length"):
# Llama 3.1 8B Instruct, QLoRA r32 on every linear layer, batch 1, sequences padded to the length.
PUBLISHED_MAX_CONTEXT = {12: 21_848, 16: 40_724, 24: 78_475, 40: 153_977, 48: 191_728, 80: 342_733}


def _max_context(gb: int) -> int:
    gpu = GpuSpec.custom(gb * 10**9)
    lo, hi = 512, 1 << 20

    def fits(seq: int) -> bool:
        s = _unsloth(seq=seq, lora_rank=32, lora_alpha=32, attn="flash")
        return estimate(LLAMA, s, gpu).device_total_bytes <= gpu.usable_memory_bytes

    while hi - lo > 256:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("gb", sorted(PUBLISHED_MAX_CONTEXT))
def test_the_longest_context_is_near_unsloths_published_table(gb):
    """The estimate's longest context per card size against Unsloth's own table: 1.23-1.24 times it
    (the transformers-5 HF recipe's longest against the same table's "Hugging Face + FA2" column is
    1.14-1.33 times it: the table runs shorter than the estimates on both paths, docs/frameworks.md)."""
    ratio = _max_context(gb) / PUBLISHED_MAX_CONTEXT[gb]
    assert 1.0 < ratio < 1.3, ratio


def test_llama_8b_at_32k_plans_onto_a_4090_in_vram():
    p = plan("llama-3.1-8b", "rtx-4090", seq=32768, framework="unsloth")
    assert p.fits and not p.tight and p.setup.framework == "unsloth" and residency(p.setup) == 0
    assert p.setup.lora_rank <= 64
    assert p.gpu.usable_memory_bytes - p.breakdown.device_total_bytes >= 0.10 * p.gpu.usable_memory_bytes


@pytest.mark.parametrize("args, match", [
    (("--method", "full"), "full fine-tuning"),
    (("--method", "lora", "--quant", "int8"), "--quant int8"),
    (("--method", "qlora", "--gpus", "2"), "several GPUs"),
    (("--method", "lora", "--liger"), "own kernels"),
])
def test_what_unsloth_runs_otherwise_is_refused_in_one_line(args, match):
    assert_user_error(run("estimate", "llama-3.1-8b", "--framework", "unsloth", *args), match)


def test_emit_writes_unsloths_config_and_a_fixed_script(tmp_path):
    import py_compile

    import yaml

    from vramplan.emit import render
    from vramplan.emit.unsloth import SCRIPT

    p = plan("llama-3.1-8b", "rtx-4090", seq=32768, framework="unsloth", method="qlora")
    files = render(p)
    assert sorted(files) == ["unsloth.yaml", "unsloth_train.py", "vramplan.json"]
    cfg = yaml.safe_load(files["unsloth.yaml"])
    assert cfg["max_seq_length"] == 32768 and cfg["load_in_4bit"] is True and cfg["lora"]["r"] == p.setup.lora_rank
    assert cfg["use_gradient_checkpointing"] == "unsloth" and cfg["training"]["optim"] == "adamw_8bit"
    assert files["unsloth_train.py"] == SCRIPT  # the same text for every plan: no plan value becomes code
    (tmp_path / "t.py").write_text(SCRIPT)
    py_compile.compile(str(tmp_path / "t.py"), doraise=True)
    trl = plan("llama-3.1-8b", "rtx-4090", seq=2048, framework="trl")
    assert_user_error(run("estimate", "llama-3.2-1b", "--framework", "unsloth", "--method", "qlora",
                          "--loss", "trl"), "loss 'unsloth'")
    with pytest.raises(SpecError, match="Unsloth cannot express framework trl"):
        render(trl, ["unsloth"])


def test_the_first_loss_sees_the_card_less_the_context_and_the_allocators_reserve():
    """``_get_chunk_multiplier`` (functools.cache) reads ``torch.cuda.mem_get_info`` at the first loss:
    the CUDA context and the allocator's reserve are not free. On an 8 GB card at 2048 tokens that is
    under 2 x 0.98 GiB, so the fp32 logits are cut in 4 chunks (counting only the tensors: 1 chunk, and
    2048 tokens took more memory than 4096)."""
    from vramplan import load_gpu

    gpu = load_gpu("rtx-4060")
    short, long = (estimate(LLAMA, _unsloth(seq=s), gpu) for s in (2048, 4096))
    assert short.component("logits_loss") == 2 * 2 * (2048 // 4) * LLAMA.vocab_size + 2 * 2048 * LLAMA.hidden_size
    assert short.device_total_bytes < long.device_total_bytes


def test_the_allocator_term_says_unsloth_turns_on_expandable_segments():
    gpu = GpuSpec.custom(24 * GiB)
    notes = {fw: next(c.note for c in estimate(LLAMA, s, gpu).components if c.name == "allocator_overhead")
             for fw, s in (("unsloth", _unsloth()), ("hf", _setup()))}
    assert "expandable segments" in notes["unsloth"] and "upper bound" in notes["unsloth"]
    assert "expandable" not in notes["hf"]


def test_model_types_outside_fastlanguagemodels_dispatch_recompute_as_transformers():
    """unsloth 2026.8.19 ``FastLanguageModel.from_pretrained`` runs its own decoder forward and fused LoRA
    kernels for llama, mistral, gemma, gemma2, qwen2, qwen3 and qwen3_moe only; Gemma 3, Phi-3 and the rest
    go to ``FastModel`` (transformers' modeling code, compiled): their recomputed layer is transformers', said
    in a warning, while the offloaded checkpointing and the fused loss stay Unsloth's."""
    from vramplan.setup.checks import check

    s = Setup(framework="unsloth", loss="unsloth", method="qlora", checkpointing=True, seq=4096)
    hf = s.replace(framework="trl", loss="hf")
    for name, fast in (("llama-3.2-3b", True), ("qwen3-4b", True), ("gemma-3-1b", False), ("phi-3.5-mini", False)):
        m = load_model(name)
        assert unsloth.fast_path(m, s) is fast
        rec = next(c.bytes for c in estimate(m, s).components if c.name == "recompute")
        if fast:
            assert rec == unsloth.recompute_bytes(m, s)
            assert not any("FastModel" in w for w in check(m, s))
        else:
            assert rec == next(c.bytes for c in estimate(m, hf).components if c.name == "recompute")
            assert rec > unsloth.recompute_bytes(m, s)
            assert any(f"--framework unsloth on {m.model_type}: FastLanguageModel hands it to FastModel" in w
                       for w in check(m, s))
        # Unsloth's offloaded checkpointing and fused loss either way
        assert estimate(m, s).host_bytes == unsloth.host_bytes(m, s) > 0


def test_the_dynamic_upload_unsloth_would_load_is_named_and_the_emitted_config_loads_the_plain_one():
    """With ``load_in_4bit=True`` Unsloth 2026.8.19 swaps a 16-bit name for its own 4-bit upload
    (loader_utils.py ``__get_model_name``): for Llama-3.1-8B the dynamic ``-unsloth-bnb-4bit`` one, which keeps
    modules in 16 bits that the estimate does not count. The plan says so; unsloth.yaml names the plain
    ``-bnb-4bit`` upload with ``use_exact_model_name`` (what the estimate counts); Mistral-7B's default is
    plain already (no note), an explicit upload name is kept, and 16-bit LoRA is left to Unsloth's mapper."""
    import yaml

    from vramplan.emit import render
    from vramplan.model.profiles import unsloth_checkpoint_note, unsloth_upload

    assert unsloth_upload("llama-3.1-8b") == {"loads": "unsloth/Llama-3.1-8B-unsloth-bnb-4bit", "dynamic": True,
                                              "plain_4bit": "unsloth/Llama-3.1-8B-bnb-4bit"}
    assert unsloth_upload("mistral-7b")["dynamic"] is False
    assert unsloth_upload("unsloth/Llama-3.1-8B-bnb-4bit") is None  # kept as named
    assert unsloth_upload("Qwen/Qwen3-32B")["loads"].lower() == "unsloth/qwen3-32b-bnb-4bit"  # BAD_MAPPINGS
    note = unsloth_checkpoint_note("llama-3.1-8b")
    assert "for meta-llama/Llama-3.1-8B" in note and "unsloth/Llama-3.1-8B-bnb-4bit" in note

    qlora = plan("llama-3.1-8b", "rtx-4090", seq=2048, framework="unsloth", method="qlora")
    assert note in qlora.notes
    cfg = yaml.safe_load(render(qlora)["unsloth.yaml"])
    assert (cfg["model_name"], cfg["use_exact_model_name"]) == ("unsloth/Llama-3.1-8B-bnb-4bit", True)
    lora = plan("llama-3.1-8b", "rtx-4090", seq=2048, framework="unsloth", method="lora")
    cfg = yaml.safe_load(render(lora)["unsloth.yaml"])
    assert (cfg["model_name"], cfg["use_exact_model_name"]) == ("meta-llama/Llama-3.1-8B", False)
    assert not any("Unsloth loads" in n for n in lora.notes)
    mistral = plan("mistral-7b", "rtx-4090", seq=2048, framework="unsloth", method="qlora")
    assert not any("Unsloth loads" in n for n in mistral.notes)
    assert not any("Unsloth loads" in n for n in plan("llama-3.1-8b", "rtx-4090", framework="trl").notes)

    out = run("estimate", "llama-3.1-8b", "--framework", "unsloth", "--method", "qlora", "--json")
    assert out.exit_code == 0 and note in __import__("json").loads(out.stdout)["notes"]
    named = run("estimate", "unsloth/Llama-3.1-8B-unsloth-bnb-4bit", "--framework", "unsloth")
    assert "an Unsloth dynamic 4-bit upload" in named.stderr and "Unsloth loads" not in named.stderr


def test_the_uploads_table_is_unsloths_mapper():
    """profiles/unsloth_uploads.json is what tools/unsloth_uploads.py reads off the unsloth 2026.8.19 wheel
    (VRAMPLAN_UNSLOTH_WHEEL; .ci/run downloads it)."""
    import importlib.util
    import json
    import os
    from pathlib import Path

    wheel = os.environ.get("VRAMPLAN_UNSLOTH_WHEEL")
    if not wheel:
        pytest.skip("VRAMPLAN_UNSLOTH_WHEEL not set (the unsloth 2026.8.19 wheel)")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("unsloth_uploads", root / "tools" / "unsloth_uploads.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    committed = json.loads((root / "profiles" / "unsloth_uploads.json").read_text())
    assert tool.build(Path(wheel)) == committed
