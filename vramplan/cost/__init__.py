"""The cost model: the time of one training step and tokens/s, a first-order roofline checked
against published throughput, torch-free and pure.

``model`` (``step_cost``: compute at a modelled utilisation, recompute, dequantization, optimizer,
offload and ZeRO/FSDP traffic over the card's links), ``counts`` (what it multiplies), ``parallel``
(the groups and links of HSDP and TP x FSDP2), ``cp`` (context parallelism's ring),
``objectives`` (DPO/GRPO steps: reference forward, generation), ``throughput`` (published tokens/s
vs the model) and ``fit`` (the refit of its constants from ``calibration/throughput/``).

May import: util, specs, model, estimator.
"""
