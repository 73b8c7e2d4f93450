"""Plan files and reports: the hand-off between commands and the plan's pictures.

``planfile`` (a Plan to and from JSON/YAML: written atomically; read back validated, the model and
GPU re-resolved, re-estimated, the recorded estimate kept) and ``report`` (the memory bar in the
terminal, the standalone HTML page with its inline SVG plot).

May import: util, specs, model, setup, estimator, search.
"""
