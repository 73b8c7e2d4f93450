"""The truths the estimate is verified against: real runs of the real libraries on this CPU.

A real CPU step counted live (``cpu_truth``, ``eval_truth``), TRL's own DPO/GRPO trainers
(``objectives``, ``objective_trace``), N gloo ranks running DeepSpeed ZeRO (``distributed``,
``zero_worker``), FSDP1/DDP (``fsdp``), FSDP2 (``fsdp2``), hybrid sharding (``hsdp``,
``hsdp_truth``), tensor parallelism (``tp_truth``, ``tp_lora``, ``tp_fsdp2``), context parallelism
(``cp_truth``), transformers' own layer split (``layer_split_truth``, ``layer_split_trace``,
``max_memory_truth``), and the emitted multi-GPU launch on CPU ranks (``cpu_launch``). ``ranks``
is their launcher, ``tiny`` their models, ``row`` the comparison each returns. Everything here may
import torch (workers) and is reached only from ``validate``, the tests and the benchmarks; the
product's torch side is :mod:`vramplan.run`.

May import: util, specs, model, setup, estimator, emit, run.
"""
