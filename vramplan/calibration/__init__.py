"""Measurement and calibration: real runs recorded, and the corrections fitted from them.

``measure`` (``Measurement`` records with provenance; a plan emitted and launched in a subprocess;
JSONL appended under a lock), ``sweep`` (a matrix of runs within a time budget), ``calibrate``
(least squares of the device overheads per GPU class and torch version → ``coefficients.json``),
``published`` (published real-GPU peaks vs the estimate). The records themselves live in the
repository's ``calibration/`` folder.

May import: util, specs, bands, model, setup, estimator, cost, emit; run (the measuring worker,
in a subprocess or lazily).
"""
