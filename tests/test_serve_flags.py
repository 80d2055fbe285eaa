"""`kvbench run --base-url ...`: a live OpenAI-compatible server with no suite file (as
vllm bench serve), and `--save-result`, against the fake server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import fake_server

from helpers import run_cli
from kvbench.results.schema import load_record
from kvbench.run.overrides import RunFlags, resolve_suite

KEY_ENV = "KVBENCH_TEST_SERVE_KEY"
KEY = "sk-serve-flags-0123456789"


def _serve(tmp: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--base-url", url, "--num-requests", "3", "--repeat", "1",
            "--out", str(tmp / "out"), *extra]


def test_base_url_without_suite_runs_the_server_and_saves_the_result(tmp_path, capsys) -> None:
    saved = tmp_path / "res" / "result.json"
    with fake_server(max_model_len=4096, model="tiny-served") as s:
        code, printed = run_cli(_serve(tmp_path, f"http://127.0.0.1:{s.port}",
                                       "--served-model", "tiny-served",
                                       "--save-result", str(saved)), capsys)
        paths = {e["path"] for e in s.log()}
    assert code == 0, printed
    assert paths == {"/v1/completions"}
    rec = load_record(tmp_path / "out" / "tiny-served.json")
    assert rec.status == "ok" and rec.summary["completed"] == 3
    assert rec.clock == "wall" and rec.engine_config["endpoint"] == f"http://127.0.0.1:{s.port}/v1"
    data = json.loads(saved.read_text())
    assert data["schema"] == 1 and data["command"].startswith("kvbench run --base-url")
    assert {"date", "machine", "workload", "device", "clock"} <= data.keys()
    entry = data["engines"]["tiny-served"]
    assert entry["status"] == "ok" and entry["summary"]["completed"] == 3
    assert entry["summary"]["mean_ttft_ms"] == rec.summary["mean_ttft_ms"]
    assert "curves" not in entry and "requests" not in entry


def test_chat_endpoint_and_key_from_the_named_variable(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with fake_server(max_model_len=4096, api_key=KEY) as s:
        code, printed = run_cli(_serve(tmp_path, s.endpoint, "--endpoint", "/v1/chat/completions",
                                       "--api-key-env", KEY_ENV), capsys)
        log = s.log()
    assert code == 0, printed
    assert {e["path"] for e in log} == {"/v1/chat/completions"}
    assert all(isinstance(e["body"]["messages"][0]["content"], list) for e in log)
    rec = load_record(tmp_path / "out" / "openai.json")
    assert rec.status == "ok" and rec.summary["completed"] == 3 and rec.engine_config["chat"]
    assert rec.engine_config["endpoint"] == s.endpoint  # /v1 not given twice
    assert KEY not in (tmp_path / "out" / "openai.json").read_text() and KEY not in printed


@pytest.mark.parametrize(("args", "says"), [
    (["--endpoint", "/v1/completions"], "--endpoint needs --base-url"),
    (["--served-model", "m", "--api-key-env", "K"], "--served-model, --api-key-env needs"),
    (["--base-url", "http://127.0.0.1:9", "--device", "sim:a100-80gb"], "drop --device"),
    (["--base-url", "http://127.0.0.1:9", "--clock", "virtual"], "drop --clock virtual"),
    (["--base-url", "http://127.0.0.1:9", "--endpoint", "/v1/embeddings"], "ending in"),
    (["--base-url", "ftp://127.0.0.1:9"], "--base-url: "),
    (["--base-url", "http://user:sk-secret@127.0.0.1:9"], "must not hold credentials"),
    (["--base-url", "http://127.0.0.1:9", "--api-key-env", "sk-abc-123"], "not the key itself"),
    (["--base-url", "http://127.0.0.1:9/?key=sk-secret"], "without a query"),
    (["--base-url", "http://127.0.0.1:9", "--save-result", "out.txt"], "ending in .json"),
    (["quick-sim", "--base-url", "http://127.0.0.1:9"], "add --device cpu"),
])
def test_bad_combinations_exit_2_with_a_message(args, says, tmp_path, capsys) -> None:
    code, printed = run_cli(["run", *args, "--out", str(tmp_path / "o")], capsys)
    assert code == 2, printed
    assert says in printed and "Traceback" not in printed
    assert "sk-secret" not in printed and "sk-abc-123" not in printed
    assert not (tmp_path / "o").exists()


def test_save_result_into_a_folder_is_refused_before_the_run(tmp_path, capsys) -> None:
    code, printed = run_cli(["run", "--base-url", "http://127.0.0.1:9", "--save-result",
                             str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "ending in .json" in printed


def test_an_unreachable_server_exits_2_saying_so(tmp_path, capsys) -> None:
    with fake_server() as s:
        port = s.port  # free once the server is gone
    code, printed = run_cli(_serve(tmp_path, f"http://127.0.0.1:{port}"), capsys)
    assert code == 2, printed
    assert "Traceback" not in printed and str(port) in printed


@pytest.mark.parametrize(("served", "engines", "name", "chosen"), [
    ("org/model-7b", None, "openai", ["openai"]),  # not a file name
    ("paged", None, "openai", ["openai"]),  # would shadow the built-in engine
    ("m1", "paged,openai", "m1", ["paged", "m1"]),
    ("m1", "paged", "m1", ["paged", "m1"]),
    (None, "contiguous", "openai", ["contiguous", "openai"]),
])
def test_the_served_engine_is_named_and_selected(served, engines, name, chosen) -> None:
    suite, _ = resolve_suite(None, RunFlags(base_url="http://127.0.0.1:8000",
                                            served_model=served, engines=engines))
    assert suite.run.engines == chosen and suite.run.clock == "wall"
    section = suite.engine(name)
    assert section.kind == "openai" and section.served_model == served


@pytest.mark.parametrize(("url", "path", "endpoint", "chat"), [
    ("http://127.0.0.1:8000", None, "http://127.0.0.1:8000/v1", False),
    ("http://127.0.0.1:8000/v1/", "/v1/chat/completions", "http://127.0.0.1:8000/v1", True),
    ("https://h.example/api", "/v1/completions", "https://h.example/api/v1", False),
])
def test_base_url_and_endpoint_make_the_api_root(url, path, endpoint, chat) -> None:
    suite, _ = resolve_suite(None, RunFlags(base_url=url, endpoint=path))
    section = suite.engine("openai")
    assert section.endpoint == endpoint and section.chat is chat
