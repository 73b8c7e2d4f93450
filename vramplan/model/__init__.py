"""The model side: a model's ``config.json`` becomes the :class:`~vramplan.model.modelspec.ModelSpec`
the estimator counts from.

``modelspec`` (the frozen types: ModelSpec, LinearSpec, MoeSpec, FamilyTraits; truncating and
narrowing a config), ``architecture`` (config.json → ModelSpec per family, exact parameter counts,
every Linear by name), ``traits`` (the family traits the estimator reads: norm style, parallel blocks,
RoPE width, dropout masks, sliding layers), ``profiles`` (the shipped model configs and GPU table, aliases, local paths,
Hub ids), ``rawinput`` (a config validated where it enters: size, encoding, kinds and ranges).

May import: util, specs; run lazily (``run.meta``: the meta-device fallback for an unknown
``model_type``, the one torch path, loaded only for such a model).
"""
