"""VRAMPLAN_HUB=modelscope: a repo id's config.json over ModelScope's file API (model/modelscope.py), served
here by a real HTTP server on localhost: fetched once, cached, read offline after; every failure one line."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.model.profiles import load_model


def _config() -> dict:
    """A shipped config.json (Qwen2.5-0.5B), as ModelScope would serve it."""
    from vramplan.model.profiles import _data

    return json.loads((_data() / "models" / "Qwen--Qwen2.5-0.5B.json").read_text())


class _Server:
    def __init__(self, body: bytes, status: int = 200) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                outer.paths.append(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_a):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def modelscope(monkeypatch, tmp_path):
    monkeypatch.setenv("VRAMPLAN_HUB", "modelscope")
    monkeypatch.setenv("VRAMPLAN_CACHE", str(tmp_path / "cache"))
    load_model.cache_clear()
    yield tmp_path
    load_model.cache_clear()


def test_a_repo_id_is_fetched_from_modelscope_once_then_read_offline(modelscope, monkeypatch):
    cfg = _config()
    with _Server(json.dumps(cfg).encode()) as url:
        monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", url)
        spec = load_model("some-org/Qwen2.5-0.5B-copy")
    assert spec.source == "modelscope:some-org/Qwen2.5-0.5B-copy"
    assert spec.hidden_size == cfg["hidden_size"] and spec.num_layers == cfg["num_hidden_layers"]
    cached = modelscope / "cache" / "modelscope" / "some-org--Qwen2.5-0.5B-copy" / "config.json"
    assert json.loads(cached.read_text()) == cfg
    load_model.cache_clear()  # the server is gone: the cache answers
    monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")
    assert load_model("some-org/Qwen2.5-0.5B-copy").params_total == spec.params_total


def test_the_request_is_modelscopes_file_api(modelscope, monkeypatch):
    server = _Server(json.dumps(_config()).encode())
    with server as url:
        monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", url)
        load_model("LLM-Research/Some-Model")
    assert server.paths == ["/api/v1/models/LLM-Research/Some-Model/repo?Revision=master&FilePath=config.json"]


@pytest.mark.parametrize("status, body, fragment", [
    (404, b'{"Code": 10010205001}', "HTTP 404 (no such model, or it is private)"),
    (200, b"<html>not json</html>", "config"),
])
def test_a_failed_fetch_is_one_line_and_not_cached(modelscope, monkeypatch, status, body, fragment):
    with _Server(body, status) as url:
        monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", url)
        result = CliRunner().invoke(main, ["estimate", "some-org/missing-model"])
    assert_user_error(result, fragment)
    assert not (modelscope / "cache" / "modelscope" / "some-org--missing-model" / "config.json").exists()


def test_offline_is_one_line_at_once(modelscope, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    assert_user_error(CliRunner().invoke(main, ["estimate", "some-org/offline-model"]), "cannot be reached")


def test_a_shipped_name_never_asks_the_hub(modelscope, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")
    assert load_model("LLM-Research/Meta-Llama-3-8B-Instruct").params_total == 8_030_261_248  # a re-upload, offline


def test_an_unknown_hub_is_refused(monkeypatch):
    monkeypatch.setenv("VRAMPLAN_HUB", "gitee")
    load_model.cache_clear()
    assert_user_error(CliRunner().invoke(main, ["estimate", "some-org/model"]), "VRAMPLAN_HUB must be")
