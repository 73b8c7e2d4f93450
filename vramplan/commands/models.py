"""`vramplan models`: the shipped model profiles, with where each config comes from."""

from __future__ import annotations

import click

from .options import print_json, user_errors


def _norm(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def catalogue_rows(search: str | None = None, family: str | None = None) -> list[dict]:
    """One row per shipped config (profiles/models/), sorted by HF id, filtered by ``search`` (a case-insensitive
    substring of the id, an alias or a variant) and ``family`` (the config's model_type, or the start of the
    catalogue's family name, both compared without case, spaces or punctuation: ``gemma2`` matches "Gemma 2")."""
    from ..model.profiles import catalogue, shipped_config_ids, shipped_models, shipped_summary

    aliases = {k.lower(): v for k, v in shipped_models().items()}
    entries = catalogue()["models"]
    rows = []
    for hf_id in shipped_config_ids():
        entry = entries.get(hf_id, {})
        names = [hf_id, *aliases.get(hf_id.lower(), ()), *entry.get("variants", ())]
        if search and not any(search.lower() in n.lower() for n in names):
            continue
        model_type, params_total = shipped_summary(hf_id)
        if family:
            want = _norm(family)
            if want != _norm(model_type) and not _norm(entry.get("family", "")).startswith(want):
                continue
        rows.append({
            "hf_id": hf_id, "aliases": list(aliases.get(hf_id.lower(), ())), "model_type": model_type,
            "family": entry.get("family", ""), "params_total": params_total,
            "stated_params": entry.get("stated_params", ""), "source": entry.get("source", {}),
            "verbatim": bool(entry.get("verbatim", False)), "variants": list(entry.get("variants", ())),
            **({"warning": entry["warning"]} if entry.get("warning") else {}),
        })
    return rows


@click.command()
@click.option("--search", "search", metavar="TEXT", help="Only ids, aliases or variants containing TEXT (any case).")
@click.option("--family", "family", metavar="NAME",
              help="Only this model_type (llama, qwen2, gemma2, ...) or family (\"Llama 3.1\", qwen3, phi).")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@user_errors
def models(search: str | None, family: str | None, as_json: bool) -> None:
    """The shipped model profiles: aliases, model_type, exact parameter count (--json: family, stated count, source)."""
    rows = catalogue_rows(search, family)
    if as_json:
        print_json(rows)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    if not rows:
        console.print("no shipped model matches; `vramplan models` lists them all (any Hub id or config.json "
                      "works too)")
        return
    table = Table(show_edge=False, pad_edge=False)
    for col, kw in (("HF id", {}), ("aliases", {}), ("model_type", {}), ("params (B)", {"justify": "right"})):
        table.add_column(col, **kw)
    for r in rows:  # Text cells: the same output as plain strings without parsing each for markup
        table.add_row(Text(r["hf_id"]), Text(", ".join(r["aliases"])), Text(r["model_type"]),
                      Text(f"{r['params_total'] / 1e9:.2f}"))
    console.print(table)
    console.print(f"{len(rows)} models; -Instruct/-Chat/-it variants and re-uploads (NousResearch/*, unsloth/*, "
                  "LLM-Research/*) resolve to these configs: `--json` lists the variants")
