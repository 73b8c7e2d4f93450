"""The cost model's fitted constants and the GPU classes they hold an MFU for: data, no arithmetic.

``vramplan/cost/fit.py`` refits :data:`CONSTANTS` from ``calibration/throughput/records.jsonl`` in two
stages; ``tests/test_cost.py`` fails when the committed values drift from the refit, and
``vramplan validate --throughput`` prints per GPU class the rows each constant was fitted on, the
in-sample and the leave-one-out predicted/measured (``calibration/throughput/README.md``: the numbers).

1. **Shared** (:data:`SHARED_FIT_SOURCES`): every constant the 19 comparable rows of fms-acceleration
   ``refs/a100_80gb.csv`` exercise -- one GPU (A100-80GB, 1-2 cards), three models (Mistral-7B,
   Mixtral-8x7B, Llama-2-70B), 4096 packed tokens, checkpointing, flash-attention 2, peft 0.13.
2. **Per GPU class**: ``inv_mfu:<class>`` of a class the shared rows do not cover, fitted on that
   class's comparable rows alone (at least :data:`CLASS_MIN_ROWS`) with the shared constants held.
   Other rows of a class fitted in stage 1 (the A100-40GB rows of fsdp_qlora) are checks, not fitted.

The per-class MFUs below are fitted on AnswerDotAI/fsdp_qlora ``benchmarks_03_2024.md`` only: LoRA /
QLoRA r64 on 2 cards under FSDP (NO_SHARD, FULL_SHARD, CPU offload) with peft of early 2024, whose
adapters run in 16 bits (:data:`ADAPTER_16BIT_OVERRIDES`). They are the share of the profile's dense
16-bit TFLOP/s those runs reached; full fine-tuning on those cards is not measured.
"""

from __future__ import annotations

CONSTANTS: dict[str, float] = {
    #: 1 / MFU of executed matmul FLOPs on an A100: MFU 0.637 (19 rows, all of them)
    "inv_mfu:a100": 1.570,
    #: element-passes of 2 B over sum(in + out + 2r) of the targeted Linears per token (15 LoRA/QLoRA rows)
    "lora_passes": 62.44,
    #: fp32 passes of L x hidden x 4 B per token after k-bit preparation (4 one-GPU QLoRA rows)
    "kbit_passes": 225.9,
    #: bandwidth cost of bitsandbytes' dequantization: 1 / the share of the bandwidth it reaches (9 QLoRA rows)
    "dequant_inefficiency": 5.214,
    #: sharded-parameter collectives: exposed seconds per second of ring traffic at interconnect_gbps (11 two-GPU rows)
    "shard_comm_exposure": 2.859,
    #: 1 / MFU on an RTX 3090 (13 rows, fsdp_qlora)
    "inv_mfu:rtx-3090": 1.419,
    #: 1 / MFU on an RTX 4090 (11 rows, fsdp_qlora)
    "inv_mfu:rtx-4090": 1.160,
    #: 1 / MFU on an RTX 6000 Ada (2 rows, fsdp_qlora)
    "inv_mfu:rtx-6000-ada": 3.053,
}
#: What each constant is fitted on (rows, sources), for the report.
CONSTANT_ROWS = {"inv_mfu:a100": "19 rows, 1 source, A100-80GB", "lora_passes": "15 LoRA/QLoRA rows, 1 source",
                 "kbit_passes": "4 one-GPU QLoRA rows, 1 source", "dequant_inefficiency": "9 QLoRA rows, 1 source",
                 "shard_comm_exposure": "11 FSDP FULL_SHARD 2-GPU rows, 1 source",
                 "inv_mfu:rtx-3090": "13 LoRA/QLoRA FSDP 2-GPU rows, 1 source (fsdp_qlora)",
                 "inv_mfu:rtx-4090": "11 LoRA/QLoRA FSDP 2-GPU rows, 1 source (fsdp_qlora)",
                 "inv_mfu:rtx-6000-ada": "2 QLoRA FSDP 2-4-GPU rows, 1 source (fsdp_qlora)"}

#: The rows (repository, path) stage 1 fits the shared constants on.
SHARED_FIT_SOURCES = frozenset({("foundation-model-stack/fms-acceleration", "scripts/benchmarks/refs/a100_80gb.csv")})
#: Fewest comparable rows a GPU class needs for its own ``inv_mfu:<class>`` (one row leaves no held-out error).
CLASS_MIN_ROWS = 2

#: MFU of a GPU class no published row covers: the shipped guess (published HF runs report 35-50 %),
#: deliberately below the A100 fit: unfitted cards (consumer cards throttle below their boost clock
#: under sustained load; H100-class cards have twice the FLOPs per byte of bandwidth) are not assumed
#: to reach what an A100 reached at 16k tokens per micro-batch. Absolute tokens/s on them is unvalidated.
MFU = 0.40
#: GPU name -> MFU class of :data:`CONSTANTS` (``inv_mfu:<class>``); other cards use :data:`MFU`. A class
#: holds only the cards its rows ran on (an A100's 40/80 GB and PCIe/SXM variants are one chip and clock
#: class); a sibling card with no row (RTX 3090 Ti, L40S, ...) keeps :data:`MFU`.
MFU_CLASS = {"a100-80gb": "a100", "a100-40gb": "a100", "a100-80gb-pcie": "a100",
             "rtx-3090": "rtx-3090", "rtx-4090": "rtx-4090", "rtx-6000-ada": "rtx-6000-ada"}

#: Constants replaced for a record whose adapters run in 16 bits (``config.adapter_dtype == "bf16"``: peft
#: < 0.12 moved each adapter to its base layer's floating dtype, ``self.to(weight.device, dtype=weight.dtype)``
#: in ``LoraLayer.update_layer`` (v0.10.0 src/peft/tuners/lora/layer.py; a bnb 4-bit weight stored as bf16
#: counts); huggingface/peft#1706, ae1ae20b, first in v0.12.0, keeps them fp32: ``autocast_adapter_dtype``).
#: ``lora_passes`` is fitted on peft 0.13's fp32 adapter path on a bf16 base (input cast to fp32, dropout and
#: the A/B products in fp32, the result cast back); the 16-bit path is a few elementwise passes no row
#: separates from the matmuls' rate, so it is left inside the class's fitted MFU (0 here).
ADAPTER_16BIT_OVERRIDES = {"lora_passes": 0.0}

#: Per fitted GPU class: the held-out predicted/measured range of its rows (each row predicted by constants
#: fitted without it; ``vramplan validate --throughput``), for a band on the time and money figures of a plan
#: on that class. tokens/s true = predicted / ratio, so hours lie within [hours / hi, hours / lo].
#: tests/test_throughput_classes.py fails when these drift from the records.
CLASS_BANDS: dict[str, tuple[float, float]] = {
    "a100": (0.824, 1.167),
    "rtx-3090": (0.856, 2.052),
    "rtx-4090": (0.637, 1.374),
    "rtx-6000-ada": (0.954, 1.050),
}
