"""Validation: how far each estimate is from its truth (``vramplan validate``).

``matrix`` (the knob matrix: cases x truth → rows, median/worst per knob, what is not verifiable
here and why), ``knobs``, ``objectives`` and ``evaluation`` (the cases of the knobs with truths of
their own), ``accuracy`` (estimate vs fake-tensor trace, one model per family).

May import: util, specs, model, setup, estimator, calibration, run, truths.
"""
