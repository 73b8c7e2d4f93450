"""`vramplan models`: the shipped model profiles."""

from __future__ import annotations

import click

from .options import print_json, user_errors


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@user_errors
def models(as_json: bool) -> None:
    """The shipped model profiles, with their aliases and parameter counts."""
    from ..model.profiles import load_model, shipped_models

    rows = []
    for hf_id, aliases in sorted(shipped_models().items(), key=lambda kv: kv[0].lower()):
        spec = load_model(hf_id)
        rows.append({"hf_id": hf_id, "aliases": list(aliases), "model_type": spec.model_type,
                     "params_total": spec.params_total})
    if as_json:
        print_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for col, kw in (("HF id", {}), ("aliases", {}), ("model_type", {}), ("params (B)", {"justify": "right"})):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(r["hf_id"], ", ".join(r["aliases"]), r["model_type"], f"{r['params_total'] / 1e9:.2f}")
    Console(highlight=False).print(table)
