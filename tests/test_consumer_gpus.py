"""The consumer GeForce profiles (desktop 8-12 GB cards and laptop GPUs, RTX 30/40/50) in profiles/gpus.json:
each resolves under the names people type, no alias names two cards, usable memory follows the
file's one rule, and a small model plans onto the smallest of them."""

from __future__ import annotations

import json
import re
from collections import Counter
from importlib import resources

import pytest
from click.testing import CliRunner

import vramplan
from vramplan.cli import main
from vramplan.setup.inputs import ambiguous_gpu_alias

MiB = 1 << 20
GiB = 1 << 30

#: name -> (aliases that must resolve to it, nvidia-smi 'Total' MiB, dense bf16 TFLOP/s)
CARDS = {
    "rtx-4060": (["4060", "rtx4060", "geforce-rtx-4060", "RTX 4060"], 8188, 30.2),
    "rtx-4060-ti-8gb": (["4060-ti-8gb", "4060ti-8gb", "geforce-rtx-4060-ti-8gb"], 8188, 44.1),
    "rtx-4070": (["4070", "rtx4070", "geforce-rtx-4070"], 12282, 58.3),
    "rtx-4070-super": (["4070-super", "4070s", "rtx-4070-s", "geforce-rtx-4070-super"], 12282, 71.0),
    "rtx-3060-ti": (["3060-ti", "3060ti", "rtx3060ti", "geforce-rtx-3060-ti"], 8192, 32.4),
    "rtx-3070": (["3070", "rtx3070", "geforce-rtx-3070"], 8192, 40.6),
    "rtx-3070-ti": (["3070-ti", "3070ti", "rtx3070ti", "geforce-rtx-3070-ti"], 8192, 43.5),
    "rtx-3080-10gb": (["3080", "rtx-3080", "rtx3080", "3080-10gb", "geforce-rtx-3080"], 10240, 59.5),
    "rtx-3080-12gb": (["3080-12gb", "rtx3080-12gb", "geforce-rtx-3080-12gb"], 12288, 61.3),
    "rtx-3080-ti": (["3080-ti", "3080ti", "rtx3080ti", "geforce-rtx-3080-ti"], 12288, 68.2),
    "rtx-4060-laptop": (["4060-laptop", "rtx-4060-mobile", "4060m", "NVIDIA GeForce RTX 4060 Laptop GPU"], 8188, 29.1),
    "rtx-4070-laptop": (["4070-laptop", "rtx-4070-mobile", "4070m", "NVIDIA GeForce RTX 4070 Laptop GPU"], 8188, 40.1),
    "rtx-4080-laptop": (["4080-laptop", "rtx-4080-mobile", "4080m", "NVIDIA GeForce RTX 4080 Laptop GPU"], 12282, 67.7),
    "rtx-4090-laptop": (["4090-laptop", "rtx-4090-mobile", "4090m", "NVIDIA GeForce RTX 4090 Laptop GPU"], 16376, 79.4),
    "rtx-3070-laptop": (["3070-laptop", "rtx-3070-mobile", "3070m", "NVIDIA GeForce RTX 3070 Laptop GPU"], 8192, 33.2),
    "rtx-3080-laptop-16gb": (["rtx-3080-laptop", "3080-laptop", "3080-laptop-16gb",
                              "NVIDIA GeForce RTX 3080 Laptop GPU"], 16384, 42.0),
    # Blackwell GeForce (GB20x): nvidia-smi totals as public outputs print them (8151 / 12227 / 16303 MiB)
    "rtx-5060": (["5060", "rtx5060", "geforce-rtx-5060", "RTX 5060"], 8151, 38.4),
    "rtx-5060-ti-8gb": (["5060-ti-8gb", "5060ti-8gb", "geforce-rtx-5060-ti-8gb"], 8151, 47.4),
    "rtx-5060-ti-16gb": (["5060-ti-16gb", "rtx-5060-ti", "5060ti", "geforce-rtx-5060-ti-16gb"], 16303, 47.4),
    "rtx-5070": (["5070", "rtx5070", "geforce-rtx-5070"], 12227, 61.7),
    "rtx-5070-ti": (["5070-ti", "5070ti", "rtx5070ti", "geforce-rtx-5070-ti"], 16303, 87.9),
    "rtx-5080": (["5080", "rtx5080", "geforce-rtx-5080"], 16303, 112.6),
    # Blackwell Laptop GPUs (GB203/GB205/GB206): the rate at the boost clock at the top of NVIDIA's TGP range
    "rtx-5060-laptop": (["5060-laptop", "rtx-5060-mobile", "5060m", "NVIDIA GeForce RTX 5060 Laptop GPU"], 8151, 33.2),
    "rtx-5070-laptop": (["5070-laptop", "rtx-5070-mobile", "5070m", "NVIDIA GeForce RTX 5070 Laptop GPU"], 8151, 43.3),
    "rtx-5070-ti-laptop": (["5070-ti-laptop", "5070ti-laptop", "rtx-5070-ti-mobile",
                            "NVIDIA GeForce RTX 5070 Ti Laptop GPU"], 12227, 52.3),
    "rtx-5080-laptop": (["5080-laptop", "rtx-5080-mobile", "5080m", "NVIDIA GeForce RTX 5080 Laptop GPU"], 16303, 70.3),
    "rtx-5090-laptop": (["5090-laptop", "rtx-5090-mobile", "5090m", "NVIDIA GeForce RTX 5090 Laptop GPU"], 24463, 90.7),
}

#: compute capability by architecture (GA10x, AD10x, GB20x)
CAPABILITY = {"ampere": "8.6", "ada": "8.9", "blackwell": "12.0"}

#: per-SM dense FP16/BF16 tensor FLOP per clock with FP32 accumulate on GeForce GA10x, AD10x and GB20x
FLOP_PER_SM_CLOCK = 512


def _raw() -> list[dict]:
    return json.loads((resources.files("vramplan.profile_data") / "gpus.json").read_text())["gpus"]


def run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_new_card_resolves_by_name_and_aliases(name):
    aliases, total_mib, tflops = CARDS[name]
    gpu = vramplan.load_gpu(name)
    assert gpu.name == name and "GeForce" in gpu.display_name and gpu.bf16
    for alias in aliases:
        assert vramplan.load_gpu(alias).name == name, alias
    raw = next(g for g in _raw() if g["name"] == name)
    assert raw["memory_bytes"] == total_mib * MiB
    assert raw["bf16_tflops_dense"] == raw["fp16_tflops_dense"] == gpu.bf16_tflops_dense == tflops
    assert raw["compute_capability"] == CAPABILITY[raw["architecture"]]
    # the source names the SMs and clock the rate was derived from, and they give the rate
    derived = re.search(r"\((\d+) SMs @ (\d+) MHz", raw["source"])
    assert derived, raw["source"]
    sms, mhz = int(derived[1]), int(derived[2])
    assert round(sms * mhz * FLOP_PER_SM_CLOCK / 1e6, 1) == tflops


def test_no_alias_names_two_cards():
    counts = Counter(n.lower() for g in _raw() for n in (g["name"], *g["aliases"]))
    assert [n for n, c in counts.items() if c > 1] == []
    # nor after the normalisation load_gpu applies (spaces, underscores, "nvidia-"): "nvidia-t4" and
    # "t4" may meet, but only on the same card
    cards: dict[str, set[str]] = {}
    for g in _raw():
        for n in (g["name"], *g["aliases"]):
            key = n.lower().replace(" ", "-").replace("_", "-").removeprefix("nvidia-")
            cards.setdefault(key, set()).add(g["name"])
    assert {k: v for k, v in cards.items() if len(v) > 1} == {}


def test_usable_memory_follows_the_reserve_rule_for_every_profile():
    for g in _raw():
        total, usable, note = g["memory_bytes"], g["usable_memory_bytes"], g["memory_note"]
        assert total % MiB == 0, g["name"]
        if "1.5% display/driver reserve" in note:
            mib = total // MiB
            want = mib * 985 // 1000  # total less 1.5 %, floored to whole MiB
            assert usable == want * MiB, (g["name"], usable // MiB, want)
            assert f"'Total' {mib} MiB" in note and f"({want} MiB)" in note, g["name"]
        else:  # headless data-centre cards: the driver's total is usable
            assert usable == total, g["name"]


def test_eight_gb_cards_have_less_than_eight_gib_usable():
    eight = [n for n, (_, mib, _) in CARDS.items() if mib <= 8192]
    assert len(eight) == 12
    for name in eight:
        assert vramplan.load_gpu(name).usable_memory_bytes < 8 * GiB, name


def test_bare_3080_is_the_10gb_card_and_warns_of_the_others():
    assert vramplan.load_gpu("3080").usable_memory_bytes < vramplan.load_gpu("3080-12gb").usable_memory_bytes
    chosen, others = ambiguous_gpu_alias("rtx-3080")
    assert chosen == "rtx-3080-10gb" and "rtx-3080-12gb" in others
    chosen, others = ambiguous_gpu_alias("rtx-4060-ti")
    assert chosen == "rtx-4060-ti-16gb" and others == ["rtx-4060-ti-8gb"]
    chosen, others = ambiguous_gpu_alias("rtx-5060-ti")
    assert chosen == "rtx-5060-ti-16gb" and others == ["rtx-5060-ti-8gb"]
    assert ambiguous_gpu_alias("rtx-4060") is None and ambiguous_gpu_alias("rtx-4060-laptop") is None
    # a laptop card is another card, not a memory variant of its desktop name (nor the Ti laptop of the plain one)
    for name in ("5070", "rtx-5070", "5070-ti", "5090", "5070-laptop", "5070-ti-laptop", "5090-laptop"):
        assert ambiguous_gpu_alias(name) is None, name
    assert vramplan.load_gpu("5070-laptop").name == "rtx-5070-laptop"
    assert vramplan.load_gpu("5070-ti-laptop").name == "rtx-5070-ti-laptop"


def test_laptops_are_not_faster_than_their_desktop_names():
    for laptop, desktop in (("rtx-4060-laptop", "rtx-4060"), ("rtx-4070-laptop", "rtx-4070"),
                            ("rtx-4080-laptop", "rtx-4080"), ("rtx-4090-laptop", "rtx-4090"),
                            ("rtx-5060-laptop", "rtx-5060"), ("rtx-5070-laptop", "rtx-5070"),
                            ("rtx-5070-ti-laptop", "rtx-5070-ti"), ("rtx-5080-laptop", "rtx-5080"),
                            ("rtx-5090-laptop", "rtx-5090")):
        lap, desk = vramplan.load_gpu(laptop), vramplan.load_gpu(desktop)
        assert lap.bf16_tflops_dense < desk.bf16_tflops_dense, laptop
        assert lap.usable_memory_bytes <= desk.usable_memory_bytes, laptop
        assert lap.host_ram_per_gpu_bytes <= desk.host_ram_per_gpu_bytes, laptop


def test_llama_1b_plans_onto_an_rtx_4060():
    r = run("plan", "llama-3.2-1b", "--gpu", "rtx-4060", "--json")
    assert r.exit_code == 0, r.output
    assert "could mean" not in r.stderr
    data = json.loads(r.stdout)
    assert data["fits"] is True
    assert data["gpu"]["name"] == "rtx-4060"
    assert data["gpu"]["usable_memory_bytes"] == 8065 * MiB
    bd = data["breakdown"]
    assert bd["fits"] is True and bd["device_total_bytes"] <= bd["gpu_usable_bytes"] == 8065 * MiB


def test_gpus_json_lists_the_new_cards():
    r = run("gpus", "--json")
    assert r.exit_code == 0, r.output
    names = [row["name"] for row in json.loads(r.stdout)]
    assert set(CARDS) <= set(names)
    assert len(names) == len(set(names))
