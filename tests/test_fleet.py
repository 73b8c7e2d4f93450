"""Which GPU, how many, how long, how much (issue 30): prices with provenance (cost/prices.py), the run on
each card and count (search/fleet.py) and `plan --gpu any|list|class --dataset-tokens N`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.cost.prices import (
    parse_price_options,
    price_of,
    read_prices_file,
    shipped_prices,
    with_overrides,
)
from vramplan.model.profiles import load_gpu
from vramplan.util.errors import SpecError


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_every_shipped_price_has_a_source_and_a_date():
    table = shipped_prices()
    assert table.date and table.usd_per_kwh > 0 and "http" in table.electricity_source
    assert len(table.rent) >= 8
    for name, price in table.rent:
        assert load_gpu(name).name == name and price.kind == "rent"
        assert 0 < price.usd_per_gpu_hour < 20 and "(" in price.source and len(price.source) > 30, (name, price)


def test_an_owned_geforce_card_costs_its_electricity():
    table = with_overrides(shipped_prices(), {}, "test")
    card = load_gpu("rtx-4060-ti-16gb")
    if table.get(card.name) is None:
        price = price_of(table, card)
        assert price.kind == "electricity"
        assert price.usd_per_gpu_hour == pytest.approx(card.tdp_watts / 1000 * table.usd_per_kwh)
    assert price_of(table, load_gpu("v100-16gb")) is None or table.get("v100-16gb") is not None


def test_user_prices_override_and_bad_ones_are_one_line(tmp_path):
    table = with_overrides(shipped_prices(), parse_price_options(["rtx-3090=0.001", "h100=2.5"]), "--price")
    assert table.get("rtx-3090").usd_per_gpu_hour == 0.001 and table.get("rtx-3090").source == "--price"
    assert table.get("h100-sxm").usd_per_gpu_hour == 2.5  # an alias names the card
    for bad, match in (("rtx-3090=-1", "0 or more"), ("rtx-3090=nan", "finite"), ("rtx-3090", "NAME=USD"),
                       ("rtx-3090=cheap", "not a number")):
        with pytest.raises(SpecError, match=match):
            parse_price_options([bad])
    with pytest.raises(SpecError, match="unknown GPU"):
        with_overrides(shipped_prices(), {"gtx-9999": 1.0}, "--price")
    good = tmp_path / "p.yaml"
    good.write_text("gpus:\n  rtx-4090: 0.3\n  a100-80gb: {usd_per_gpu_hour: 1.2}\n")
    assert read_prices_file(str(good)) == {"rtx-4090": 0.3, "a100-80gb": 1.2}
    for text in ("- 1\n- 2\n", "rtx-4090: [1]\n", "{not yaml", "rtx-4090: .inf\n"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(SpecError, match="--prices"):
            read_prices_file(str(bad))


@pytest.fixture(scope="module")
def fleet_json():
    """Four cards at 1 and 2 GPUs (the fast tier); `--gpu any` is the slow tier's."""
    r = run("plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu",
            "rtx-4090,l40s,a100-80gb,h100-sxm", "--max-gpus", "2", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.slow
def test_any_plans_at_least_eight_card_types():
    r = run("plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu", "any", "--json")
    data = json.loads(r.stdout)
    assert len({o["gpu"] for o in data["options"]}) >= 8
    assert data["options"][data["cheapest"]]["usd"] == min(o["usd"] for o in data["options"] if o["usd"] is not None)


def test_rows_have_consistent_figures(fleet_json):
    rows = fleet_json["options"]
    assert len({o["gpu"] for o in rows}) == 4 and {o["gpus"] for o in rows} <= {1, 2}
    for o in rows:
        assert o["hours"] == pytest.approx(2 * 100e6 / o["tokens_per_s"] / 3600, rel=0.02)
        if o["usd"] is not None:
            assert o["usd"] == pytest.approx(o["hours"] * o["gpus"] * o["usd_per_gpu_hour"], rel=0.01, abs=0.01)
            assert o["price_source"]
    cheapest = min((o for o in rows if o["usd"] is not None), key=lambda o: o["usd"])
    assert rows[fleet_json["cheapest"]]["usd"] == cheapest["usd"]
    assert rows[fleet_json["fastest"]]["hours"] == min(o["hours"] for o in rows)


@pytest.mark.slow
def test_a_near_free_3090_is_the_cheapest_and_rank_by_time_names_the_fastest():
    r = run("plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu", "any", "--price",
            "rtx-3090=0.001", "--rank-by", "time", "--json")
    data = json.loads(r.stdout)
    assert data["options"][data["cheapest"]]["gpu"] == "rtx-3090"
    assert data["fastest"] == 0 and data["rank_by"] == "time"


def test_a_list_budget_and_deadline_filter_and_say_what_was_cut():
    r = run("plan", "llama-3.2-1b", "--dataset-tokens", "50M", "--gpu", "rtx-4090,a100-80gb", "--max-gpus", "2",
            "--budget", "1", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert {o["gpu"] for o in data["options"]} <= {"rtx-4090", "a100-80gb"}
    assert all(o["usd"] is None or o["usd"] <= 1 for o in data["options"])
    text = run("plan", "llama-3.2-1b", "--dataset-tokens", "50M", "--gpu", "rtx-4090,a100-80gb", "--max-gpus", "2",
               "--deadline", "0.01")
    assert text.exit_code == 0 and "over the 0.01 h deadline" in text.output


def test_one_card_plan_prints_the_run():
    r = run("plan", "llama-3.2-1b", "--gpu", "a100-80gb", "--dataset-tokens", "10M", "--epochs", "3", "--json")
    data = json.loads(r.stdout)
    assert data["run"]["hours"] == pytest.approx(30e6 / data["tokens_per_s"] / 3600, rel=0.01)
    assert data["run"]["usd"] == pytest.approx(data["run"]["hours"] * data["run"]["usd_per_gpu_hour"], rel=0.01)


@pytest.mark.parametrize("args, match", [
    (("--gpu", "any"), "--dataset-tokens"),
    (("--gpu", "rtx-4090,gtx-9999", "--dataset-tokens", "1M"), "gtx-9999"),
    (("--gpu", "any", "--dataset-tokens", "1M", "--price", "rtx-4090=-2"), "0 or more"),
    (("--gpu", "any", "--dataset-tokens", "1M", "--budget", "-5"), "--budget"),
    (("--gpu", "any", "--dataset-tokens", "1M", "--out", "x.yaml"), "one card"),
])
def test_bad_fleet_input_is_one_line(args, match):
    assert_user_error(run("plan", "llama-3.2-1b", *args), match)


def test_the_json_holds_its_schema(fleet_json):
    import jsonschema

    schema = json.loads((Path(__file__).resolve().parents[1] / "docs" / "schema" / "fleet.schema.json").read_text())
    jsonschema.validate(fleet_json, schema)


def _fleet():
    from vramplan.search.fleet import Fleet, FleetOption
    from vramplan.specs import Setup

    def row(gpu, n, hours, usd):
        return FleetOption(gpu, gpu, n, 1, Setup(method="lora"), "lora <b>&", 1e6 / hours / 3600, hours, usd,
                           None if usd is None else usd / hours / n, "rent", "a <script>page</script>")
    options = (row("a100-80gb", 8, 1.0, 20.0), row("h100-sxm", 8, 0.5, 30.0), row("rtx-4090", 1, 10.0, 7.0),
               row("l4", 1, 12.0, 9.0), row("rtx-4060-ti-16gb", 1, 40.0, None))
    return Fleet("m<1>", 10**6, 1, "cost", options, cheapest=2, fastest=1, price_date="2026-12-07", cut=(),
                 no_fit=("t4 x 1",))


def test_the_pareto_front_keeps_only_rows_no_other_beats_on_both():
    from vramplan.plans.fleet_report import pareto_front

    f = _fleet()
    assert pareto_front(f.options) == [1, 0, 2]  # fastest first; l4 (slower and dearer than the 4090) is off it


def test_the_fleet_page_is_standalone_and_escapes_text(tmp_path):
    from vramplan.plans.fleet_report import fleet_html

    page = fleet_html(_fleet())
    assert "<script" not in page and "&lt;script&gt;" in page and "m&lt;1&gt;" in page
    assert 'class="front"' in page and page.count('class="point') == 4  # the unpriced row is in the table only
    assert "src=" not in page and "<link" not in page  # nothing fetched: one standalone page


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_fleet_page_renders_in_headless_chromium(tmp_path):
    import subprocess
    import tempfile

    from vramplan.plans.fleet_report import write_fleet_html

    page = write_fleet_html(_fleet(), tmp_path / "fleet.html")
    profile = tempfile.mkdtemp(prefix="vramplan-chromium-")
    base = [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-dev-shm-usage", f"--user-data-dir={profile}"]
    try:
        dom = subprocess.run(base + ["--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                             timeout=90, env={**__import__("os").environ, "HOME": profile})
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert '<svg id="fleet"' in dom.stdout and dom.stdout.count('class="point') == 4
        assert "cheapest: 1 x rtx-4090" in dom.stdout and "fastest: 8 x h100-sxm" in dom.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_plan_any_writes_the_page(tmp_path):
    out = tmp_path / "fleet.html"
    r = run("plan", "llama-3.2-1b", "--dataset-tokens", "10M", "--gpu", "rtx-4090,a100-80gb", "--max-gpus", "2",
            "--html", str(out))
    assert r.exit_code == 0, r.output
    assert '<svg id="fleet"' in out.read_text()
    again = run("plan", "llama-3.2-1b", "--dataset-tokens", "10M", "--gpu", "rtx-4090,a100-80gb", "--html", str(out))
    assert_user_error(again, "--force")
