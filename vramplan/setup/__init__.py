"""The setup and its checks: one training configuration as a value, and every reason it cannot run.

``spec`` (``Setup``: every knob a validated field), ``checks`` (setup-vs-model/GPU checks a Setup
alone cannot make; the knobs not modelled yet), ``compat`` (the combinations that do not run at the
pinned versions, each with its evidence), ``max_memory`` (``--max-memory`` caps as accelerate
parses them), ``inputs`` (the one input layer: GPUs by name or size, setups from mappings, bounded
counts, JSON/YAML read with size and depth limits), ``wording`` (how a Setup reads in words).

May import: util, specs, model; estimator lazily (``checks`` asks the estimator modules that own
a knob which setups they refuse: Liger's families, attention, context parallelism, hybrid
sharding, selective checkpointing).
"""
