"""What a GPU-hour costs: the shipped price table (``profiles/prices.json``, each price with its source and
date), an owned consumer card's electricity, and the user's own prices (``--price NAME=USD``, ``--prices
FILE``). Prices go stale: the table carries the date it was read, and every figure says where its price
came from. Torch-free; a price is a number checked like every other input (finite, not negative).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..specs import GpuSpec, SpecError

__all__ = ["Price", "PriceTable", "parse_price_options", "price_of", "read_prices_file", "shipped_prices",
           "with_overrides"]


@dataclass(frozen=True)
class Price:
    """The dollars one GPU of a card costs per hour, and where that figure comes from."""

    gpu: str
    usd_per_gpu_hour: float
    #: ``rent`` (a provider's published price), ``electricity`` (an owned card's board power at the
    #: table's electricity price), ``user`` (--price / --prices)
    kind: str
    source: str


@dataclass(frozen=True)
class PriceTable:
    """Prices per card (shipped, then the user's overrides) and the electricity price owned cards run at."""

    date: str
    rent: tuple[tuple[str, Price], ...]
    usd_per_kwh: float
    electricity_source: str

    def get(self, gpu: str) -> Price | None:
        return dict(self.rent).get(gpu)


def _check(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{what} must be a finite number of US dollars, 0 or more; got {value!r}")
    if value > 1e4:
        raise SpecError(f"{what}: {value!r} US dollars per GPU-hour is not a price (over 10,000)")
    return float(value)


def _card(name: str, what: str) -> str:
    from ..model.profiles import load_gpu

    try:
        return load_gpu(str(name)).name
    except SpecError:
        raise SpecError(f"{what}: unknown GPU {name!r} (`vramplan gpus` lists them)") from None


def _from_json(data: Any, where: str) -> PriceTable:
    try:
        elec = data["electricity"]
        rent = []
        for name, row in sorted(data["gpus"].items()):
            src = row["source"]
            via = f"; read from {src['via']}" if src.get("via") else ""
            text = f"{src['provider']} {row.get('kind', 'on-demand')}, {src['date']} ({src['url']}{via})"
            rent.append((name, Price(name, _check(row["usd_per_gpu_hour"], f"{where}: {name}"), "rent", text)))
        return PriceTable(str(data["date"]), tuple(rent), _check(elec["usd_per_kwh"], f"{where}: electricity"),
                          f"{elec['source']['name']}, {elec['source']['date']} ({elec['source']['url']})")
    except (KeyError, TypeError, AttributeError) as exc:
        raise SpecError(f"{where}: not a vramplan price table ({exc!s})") from None


@functools.lru_cache(maxsize=1)
def shipped_prices() -> PriceTable:
    """The price table in the package (``profiles/prices.json``)."""
    from importlib import resources

    path = Path(str(resources.files("vramplan.profile_data") / "prices.json"))
    return _from_json(json.loads(path.read_text()), str(path))


def price_of(table: PriceTable, gpu: GpuSpec) -> Price | None:
    """What one ``gpu`` costs per hour: the table's (or the user's) price; an owned GeForce card with no
    price, its board power at the table's electricity price; None for a card nobody prices."""
    got = table.get(gpu.name)
    if got is not None:
        return got
    if "GeForce" in (gpu.display_name or "") and gpu.tdp_watts:
        usd = gpu.tdp_watts / 1000 * table.usd_per_kwh
        return Price(gpu.name, usd, "electricity", f"owned: {gpu.tdp_watts} W board power x "
                     f"${table.usd_per_kwh:.3f}/kWh ({table.electricity_source}); --price {gpu.name}=USD to set it")
    return None


def with_overrides(table: PriceTable, prices: Mapping[str, float], source: str) -> PriceTable:
    """``table`` with the user's ``prices`` (card name -> USD per GPU-hour) in place of its own."""
    rent = dict(table.rent)
    for name, usd in prices.items():
        card = _card(name, source)
        rent[card] = Price(card, _check(usd, f"{source}: {name}"), "user", source)
    return replace(table, rent=tuple(sorted(rent.items())))


def parse_price_options(values: Iterable[str]) -> dict[str, float]:
    """``--price rtx-4090=0.35`` (repeatable, or comma-separated) -> {"rtx-4090": 0.35}."""
    out: dict[str, float] = {}
    for value in values:
        for item in str(value).split(","):
            name, sep, usd = item.strip().partition("=")
            if not sep or not name.strip():
                raise SpecError(f"--price takes NAME=USD (US dollars per GPU-hour), e.g. rtx-4090=0.35; got {item!r}")
            try:
                number = float(usd)
            except ValueError:
                raise SpecError(f"--price {name.strip()}: {usd!r} is not a number of US dollars") from None
            out[name.strip()] = _check(number, f"--price {name.strip()}")
    return out


def read_prices_file(path: str) -> dict[str, float]:
    """A YAML or JSON file of prices: ``{rtx-4090: 0.35, h100-sxm: 2.5}`` or the same under ``gpus:``
    (each a number, or a mapping with ``usd_per_gpu_hour``)."""
    from ..util.numbers import check_numbers

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(f"--prices {path}: {exc.strerror or exc}") from None
    try:
        import yaml

        data = yaml.safe_load(text)
    except Exception as exc:  # a YAML error of any kind is the user's file, said in one line
        raise SpecError(f"--prices {path}: not YAML or JSON ({str(exc).splitlines()[0]})") from None
    check_numbers(data, f"--prices {path}")
    if isinstance(data, dict) and isinstance(data.get("gpus"), dict):
        data = data["gpus"]
    if not isinstance(data, dict) or not data:
        raise SpecError(f"--prices {path}: expected a table of GPU name -> US dollars per GPU-hour")
    out = {}
    for name, row in data.items():
        usd = row.get("usd_per_gpu_hour") if isinstance(row, dict) else row
        out[str(name)] = _check(usd, f"--prices {path}: {name}")
    return out
