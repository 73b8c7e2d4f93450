"""``plan MODEL --gpu any|consumer|cloud|A,B,C --dataset-tokens N``: the run on each card and count
(vramplan/search/fleet.py), as a table or JSON; and the whole-run figures of a one-card plan."""

from __future__ import annotations

from typing import Any

import click

from ..specs import Plan, SpecError
from .options import print_json

FLEET_WORDS = ("any", "consumer", "cloud")


def is_fleet(gpu_name: str | None) -> bool:
    """``--gpu`` names several cards: a class or a comma-separated list."""
    return bool(gpu_name) and (gpu_name in FLEET_WORDS or "," in gpu_name)


def price_table(price_args: tuple[str, ...], prices_file: str | None):
    """The shipped prices with ``--prices FILE`` and then ``--price NAME=USD`` over them."""
    from ..cost.prices import parse_price_options, read_prices_file, shipped_prices, with_overrides

    table = shipped_prices()
    if prices_file:
        table = with_overrides(table, read_prices_file(prices_file), f"--prices {prices_file}")
    if price_args:
        table = with_overrides(table, parse_price_options(price_args), "--price")
    return table


def run_json(plan: Plan, dataset_tokens: int, epochs: int, table) -> dict[str, Any] | None:
    """The whole run of a one-card plan: hours, dollars, the price and where it comes from."""
    from ..search.fleet import option_of

    if not plan.fits or not plan.tokens_per_s:
        return None
    o = option_of(plan, plan.gpu, plan.setup.gpus, plan.nodes, dataset_tokens * epochs, table)
    return {"dataset_tokens": dataset_tokens, "epochs": epochs, "gpus": o.gpus, "hours": round(o.hours, 4),
            "usd": None if o.usd is None else round(o.usd, 2), "usd_per_gpu_hour": o.usd_per_gpu_hour,
            "price_kind": o.price_kind, "price_source": o.price_source, "price_date": table.date}


def run_line(run: dict[str, Any] | None) -> str | None:
    """The run in words, wrapped to the terminal like the plan's own lines."""
    if run is None:
        return None
    import shutil
    import textwrap
    money = (f"${run['usd']:,.2f} at ${run['usd_per_gpu_hour']:.3f}/GPU-h ({run['price_source']})"
             if run["usd"] is not None else "no price for this card (--price NAME=USD)")
    text = (f"run: {run['dataset_tokens']:,} tokens x {run['epochs']} epoch{'s' if run['epochs'] > 1 else ''} on "
            f"{run['gpus']} GPU{'s' if run['gpus'] > 1 else ''}: {run['hours']:,.1f} h, {money}; prices of "
            f"{run['price_date']}")
    return "\n".join(textwrap.wrap(text, shutil.get_terminal_size((100, 24)).columns - 1))


def plan_fleet(model: str, gpu_name: str, *, dataset_tokens: int | None, epochs: int, max_gpus: int, rank_by: str,
               budget: float | None, deadline: float | None, table, as_json: bool, plan_kwargs: dict,
               fixed: dict, html_file: str | None = None) -> None:
    """Plan ``model`` on every card and count ``gpu_name`` names and print the comparison."""
    from ..estimator.corrections import calibration_for
    from ..search import plan as run_plan
    from ..search.fleet import cards_for, compare

    if dataset_tokens is None:
        raise SpecError("--gpu with several cards compares whole runs: pass --dataset-tokens N (e.g. 100M)")
    cards = cards_for(gpu_name)

    def one(model, card, **kw):
        return run_plan(model, card, corrections=calibration_for(card)[0], **plan_kwargs, **kw)

    fleet = compare(model, cards, dataset_tokens=dataset_tokens, epochs=epochs, max_gpus=max_gpus, prices=table,
                    rank_by=rank_by, budget=budget, deadline=deadline, plan_one=one, **fixed)
    if html_file:
        from ..plans.fleet_report import write_fleet_html

        write_fleet_html(fleet, html_file)
    stack = plan_kwargs.get("stack")
    modelled = None if stack is None or stack.is_default else stack.transformers  # plan --transformers
    if as_json:
        print_json({**fleet.to_json(), **({"modelled_versions": {"transformers": modelled}} if modelled else {})})
    else:
        _print_fleet(fleet)
        if modelled:
            click.echo(f"models transformers {modelled} (--transformers): every row's estimate and speed follow it")
    if html_file:
        click.echo(f"wrote {html_file}", err=True)


def _print_fleet(fleet) -> None:
    click.echo(f"{fleet.model}: {fleet.dataset_tokens:,} tokens x {fleet.epochs} epoch"
               f"{'s' if fleet.epochs > 1 else ''}, ranked by {fleet.rank_by}")
    if not fleet.options:
        click.echo("no card and count fits" + (f" ({'; '.join(fleet.cut)})" if fleet.cut else ""))
        return
    header = f"{'':2}{'GPU':<18}{'GPUs':>5}{'tokens/s':>11}{'hours':>9}{'USD':>11}{'$/GPU-h':>9}  plan"
    click.echo(header)
    for i, o in enumerate(fleet.options):
        mark = ("$" if i == fleet.cheapest else " ") + (">" if i == fleet.fastest else " ")
        usd = "-" if o.usd is None else f"{o.usd:,.2f}"
        rate = "-" if o.usd_per_gpu_hour is None else f"{o.usd_per_gpu_hour:.3f}"
        click.echo(f"{mark}{o.gpu[:17]:<18}{o.gpus:>5}{o.tokens_per_s:>11,.0f}{o.hours:>9,.2f}{usd:>11}"
                   f"{rate:>9}  {o.plan_line}")
    if fleet.cheapest is not None:
        c = fleet.options[fleet.cheapest]
        click.echo(f"cheapest ($): {c.gpus} x {c.gpu}, ${c.usd:,.2f} in {c.hours:,.2f} h")
        click.echo(f"  price: {c.price_source}")
    f = fleet.options[fleet.fastest]
    click.echo(f"fastest (>): {f.gpus} x {f.gpu}, {f.hours:,.2f} h" + ("" if f.usd is None else f", ${f.usd:,.2f}"))
    for line in fleet.cut:
        click.echo(f"cut: {line}")
    if fleet.no_fit:
        click.echo(f"nothing fits on: {', '.join(fleet.no_fit)}")
    click.echo(f"prices of {fleet.price_date} (profiles/prices.json; an owned GeForce card at its board power's "
               "electricity): --price NAME=USD or --prices FILE to use yours. Hours from the cost model's tokens/s "
               "(no measured band per card class yet)")
