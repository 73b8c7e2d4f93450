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
    if not rows:
        click.echo("no shipped model matches; `vramplan models` lists them all (any Hub id or config.json works too)")
        return
    cells = [(r["hf_id"], ", ".join(r["aliases"]), r["model_type"], f"{r['params_total'] / 1e9:.2f}") for r in rows]
    for line in _table(("HF id", "aliases", "model_type", "params (B)"), cells):
        click.echo(line)
    import shutil
    import textwrap

    click.echo(textwrap.fill(f"{len(rows)} models; -Instruct/-Chat/-it variants and re-uploads (NousResearch/*, "
                             "unsloth/*, LLM-Research/*) resolve to these configs: `--json` lists the variants",
                             shutil.get_terminal_size((80, 24)).columns, break_on_hyphens=False))


def _table(head: tuple[str, ...], cells: list[tuple[str, ...]]) -> list[str]:
    """The lines of a table in rich's simple layout (┃ header, ━╇ rule, │ rows, the last column right-aligned),
    fitted to the terminal's width by wrapping the first two columns (the id at its hyphens, the aliases at their
    commas). Plain strings: rich's layout of hundreds of rows took longer than reading the catalogue
    (benchmarks/cli_latency.py)."""
    import shutil
    import textwrap

    width = shutil.get_terminal_size((80, 24)).columns
    n = len(head)
    widths = [max(len(head[c]), *(len(row[c]) for row in cells)) for c in range(n)]
    room = width - 3 * (n - 1) - sum(widths[2:])  # for the two wrapped columns
    if widths[0] + widths[1] > room:
        first = max(len(head[0]), min(widths[0], max(room // 2, room - widths[1])))
        widths[0], widths[1] = first, max(len(head[1]), room - first)

    def line(values: tuple[str, ...], sep: str) -> str:
        return sep.join(v.ljust(w) if c < n - 1 else v.rjust(w)
                        for c, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    out = [line(head, " ┃ "), "━╇━".join("━" * w for w in widths)]
    for row in cells:
        parts = [textwrap.wrap(row[c], widths[c], break_long_words=True, break_on_hyphens=c == 0) or [""]
                 for c in (0, 1)]
        for k in range(max(map(len, parts))):
            rest = row[2:] if k == 0 else ("",) * (n - 2)
            out.append(line((*(p[k] if k < len(p) else "" for p in parts), *rest), " │ "))
    return out
