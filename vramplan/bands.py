"""Error bands and calibration provenance of a Breakdown (issue 13): frozen dataclasses, no logic
beyond (de)serialisation. :mod:`vramplan.calibration.calibrate` computes the bands from residuals;
:mod:`vramplan.estimator.corrections` reads them back with the coefficients."""

from __future__ import annotations

from dataclasses import dataclass

#: The headline numbers of a Breakdown, in order; each has its own error band.
HEADLINES = ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes")

#: The documented band when no measurement sets one (the raw model, or a number no row measured):
#: the accuracy bar ``vramplan validate`` holds the estimator to against its CPU truths.
DEFAULT_BAND = 0.05


@dataclass(frozen=True)
class ErrorBand:
    """Where the truth of one headline number lies relative to its estimate: between
    ``estimate * (1 + low)`` and ``estimate * (1 + high)`` (``low`` <= 0 <= ``high``). ``rows``
    measurements set it (0: no measurement, the default band); ``basis`` says which."""

    low: float
    high: float
    rows: int = 0
    basis: str = "default"

    def bounds(self, estimate_bytes: int) -> tuple[int, int]:
        return int(estimate_bytes * (1 + self.low)), int(estimate_bytes * (1 + self.high))

    def to_json(self) -> dict:
        return {"low": self.low, "high": self.high, "rows": self.rows, "basis": self.basis}

    @classmethod
    def from_json(cls, data: dict) -> ErrorBand:
        return cls(float(data["low"]), float(data["high"]), int(data.get("rows", 0)), str(data.get("basis", "")))


DEFAULT_ERROR_BAND = ErrorBand(-DEFAULT_BAND, DEFAULT_BAND, 0,
                               f"default ±{DEFAULT_BAND:.0%}: no measurement of this number applies")


@dataclass(frozen=True)
class ErrorBands:
    """One :class:`ErrorBand` per headline number (from the residuals of the quantity it predicts)."""

    tensor_peak_bytes: ErrorBand = DEFAULT_ERROR_BAND
    peak_allocated_bytes: ErrorBand = DEFAULT_ERROR_BAND
    peak_reserved_bytes: ErrorBand = DEFAULT_ERROR_BAND
    device_total_bytes: ErrorBand = DEFAULT_ERROR_BAND

    def to_json(self) -> dict:
        return {k: getattr(self, k).to_json() for k in HEADLINES}

    @classmethod
    def from_json(cls, data: dict) -> ErrorBands:
        return cls(**{k: ErrorBand.from_json(data[k]) for k in HEADLINES if k in data})


#: The band of an uncalibrated estimate (``--no-calibration``): the default for every number.
DEFAULT_ERROR_BANDS = ErrorBands()


@dataclass(frozen=True)
class CalibrationInfo:
    """What calibration an estimate applied: the coefficients file (``source``: ``shipped``, or a
    path), the group used (``sm80/torch-2.4``, or ``pooled`` when this GPU's class has no fit of
    its own: ``gpu_class_match`` False), what it was fitted on, the file's format version and
    fit id, and which device terms are fitted and which stay published (quoted) figures."""

    source: str
    group: str
    fitted_on: str
    version: str
    fitted: tuple[str, ...]
    quoted: tuple[str, ...]
    gpu_class_match: bool

    def to_json(self) -> dict:
        return {"source": self.source, "group": self.group, "fitted_on": self.fitted_on, "version": self.version,
                "fitted": list(self.fitted), "quoted": list(self.quoted), "gpu_class_match": self.gpu_class_match}
