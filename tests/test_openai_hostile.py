"""The openai engine against hostile servers (a fake on 127.0.0.1): echoed secrets,
malformed replies, unbounded bodies, CRLF streams, wrong lengths, redirects, unreadable
/metrics, a run deadline, and runs in which nothing completed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_openai import fake_server, plan_served, run_served

from helpers import make_workload, run_cli, text_request
from kvbench.errors import KvbenchError
from kvbench.results.schema import load_record
from kvbench.workloads.io import save_workload
from kvbench.workloads.model import Request

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

KEY = "kvb-7f3a91-do-not-store"
KEY_ENV = "KVBENCH_HOSTILE_KEY"


def _workload(outputs: tuple[int, ...]) -> list[Request]:
    return [text_request(f"r{i}", 30 + i, out, arrival=0.005 * i)
            for i, out in enumerate(outputs)]


def _rows(rec) -> dict[int, Any]:
    """Request rows by their output length (each test gives its requests distinct ones)."""
    return {r.output_tokens: r for r in rec.requests}


def _written(out_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in out_dir.rglob("*") if p.is_file())


def _token_frame(end: str = "\n\n") -> str:
    return 'data: {"choices": [{"index": 0, "text": " w", "token_ids": [7]}]}' + end


def _frames(tokens: int, *extra: str) -> dict[str, Any]:
    """A scripted stream: ``tokens`` good token chunks, then ``extra`` events, then [DONE]."""
    return {"frames": [[_token_frame(), tokens], *(f"data: {e}\n\n" for e in extra),
                       "data: [DONE]\n\n"]}


# -- secrets ------------------------------------------------------------------------------

def test_a_key_echoed_by_the_server_reaches_neither_record_nor_output(
        tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    error_event = '{"error": {"message": "token {key} refused (header {auth})"}}'
    with fake_server(api_key=KEY, echo_auth=True, status_on={"5": 401, "6": 403},
                     raw_on={"7": {"frames": [f"data: {error_event}\n\n"]}}) as s:
        rec, plan = run_served(make_workload(_workload((4, 5, 6, 7))), tmp_path,
                               {"endpoint": s.endpoint, "api_key_env": KEY_ENV})
        log = s.log()
    # The server did get the key, so its replies did echo it.
    assert {e["authorization"] for e in log} == {f"Bearer {KEY}"}
    rows = _rows(rec)
    assert rows[4].status == "ok" and rec.status == "ok"
    assert rows[5].reason.startswith("HTTP 401") and "for Bearer ***" in rows[5].reason
    assert rows[6].reason.startswith("HTTP 403") and "***" in rows[6].reason
    assert rows[7].reason == "error event: token *** refused (header Bearer ***)"
    assert KEY not in _written(plan.out_dir)
    assert KEY not in json.dumps(rec.model_dump())
    out = capsys.readouterr()
    assert KEY not in out.out + out.err


def _suite_file(tmp: Path, endpoint: str, outputs: tuple[int, ...], **section: Any) -> Path:
    save_workload(make_workload(_workload(outputs)), tmp / "wl.jsonl")
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in section.items())
    path = tmp / "served.toml"
    path.write_text(
        'name = "served"\n[workload]\nfile = "wl.jsonl"\n[run]\ndevice = "cpu"\n'
        f'[engines.live]\nkind = "openai"\nendpoint = "{endpoint}"\n{extra}'
    )
    return path


def test_a_run_where_every_request_failed_says_so_and_exits_non_zero(
        tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with fake_server(api_key=KEY, echo_auth=True,
                     status_on={"4": 401, "5": 401, "6": 401}) as s:
        suite = _suite_file(tmp_path, s.endpoint, (4, 5, 6), api_key_env=KEY_ENV)
        code, printed = run_cli(["run", str(suite), "--engines", "live",
                                 "--out", str(tmp_path / "out")], capsys)
    assert code == 1, printed
    assert "live failed: all 3 requests failed; the first, r0: HTTP 401" in printed
    rec = load_record(tmp_path / "out" / "live.json")
    assert rec.status == "failed" and rec.summary["failed"] == 3
    assert rec.error.startswith("all 3 requests failed; the first, r0: HTTP 401 Unauthorized")
    assert KEY not in printed and KEY not in _written(tmp_path / "out")


# -- malformed replies --------------------------------------------------------------------

# One hostile reply per output length; each breaks a field the client reads.
BAD_REPLIES = {
    3: {"frames": ['data: {"choices": [{"index": 0, "token_ids": [null]}]}\n\n']},
    4: {"frames": ['data: {"choices": [{"index": 0, "token_ids": [1.5, 2.5]}]}\n\n']},
    5: {"frames": ['data: {"choices": [{"index": 0, "token_ids": "12345"}]}\n\n']},
    6: _frames(6, '{"choices": [], "usage": "six"}'),
    7: _frames(7, '{"choices": [], "usage": [7]}'),
    8: _frames(8, '{"choices": [], "usage": {"prompt_tokens_details": "none"}}'),
    9: _frames(9, '{"choices": [], "usage": {"completion_tokens": "9"}}'),
    10: _frames(10, '{"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": -1}}}'),
    11: {"frames": ['data: {"choices": "eleven"}\n\n']},
    12: {"frames": ['data: {"choices": [{"index": 4, "text": "x"}]}\n\n']},
    13: {"frames": ['data: {"choices": [{"index": 0, "text": 13}]}\n\n']},
    14: {"frames": ['data: {"choices": [{"index": 0, "delta": "fourteen"}]}\n\n']},
    15: {"frames": ["data: [15, 15]\n\n"]},
    16: {"frames": ["data: {sixteen\n\n"]},
    17: {"frames": ["data: \udcff\udcfe\n\n"]},  # bytes that are no UTF-8
}


def test_malformed_replies_fail_only_their_own_requests(tmp_path) -> None:
    outputs = (*BAD_REPLIES, 20, 21)
    raw = {str(k): v for k, v in BAD_REPLIES.items()}
    with fake_server(raw_on=raw) as s:
        rec, _ = run_served(make_workload(_workload(outputs)), tmp_path,
                            {"endpoint": s.endpoint})
    assert rec.status == "ok", rec.error
    rows = _rows(rec)
    assert rows[20].status == rows[21].status == "ok"
    for out in BAD_REPLIES:
        assert rows[out].status == "failed", out
        assert rows[out].reason.startswith("bad reply: "), rows[out].reason
    assert rec.summary["completed"] == 2 and rec.summary["failed"] == len(BAD_REPLIES)
    assert rec.engine_config["observed"]["errors"] == {"bad reply": len(BAD_REPLIES)}


# -- streams ------------------------------------------------------------------------------

def test_crlf_separated_streams_are_read(tmp_path) -> None:
    outputs = (4, 6, 8)
    with fake_server(crlf=True) as s:
        rec, _ = run_served(make_workload(_workload(outputs)), tmp_path, {"endpoint": s.endpoint})
    assert rec.status == "ok", rec.error
    assert rec.summary["completed"] == 3 and rec.summary["total_output_tokens"] == sum(outputs)
    assert all(r.output_digest for r in rec.requests)


def test_unbounded_bodies_are_cut_off(tmp_path) -> None:
    chunk = 1 << 14
    raw = {
        # 2 MiB of one event with no line end, and 10 MiB of an error body.
        "5": {"frames": ["data: ", ["x" * chunk, 128]]},
        "6": {"status": 500, "frames": [["y" * chunk, 640]]},
    }
    with fake_server(raw_on=raw) as s:
        rec, _ = run_served(make_workload(_workload((4, 5, 6))), tmp_path,
                            {"endpoint": s.endpoint})
    rows = _rows(rec)
    assert rows[4].status == "ok"
    assert rows[5].reason == "bad reply: a stream line longer than 1048576 bytes"
    assert rows[6].reason.startswith("HTTP 500 Internal Server Error: yyy")
    assert len(rows[6].reason) < 400


def test_replies_of_any_other_length_than_forced_fail(tmp_path) -> None:
    raw = {
        "7": _frames(7, '{"choices": [], "usage": {"completion_tokens": 9}}'),
        "8": _frames(3, '{"choices": [], "usage": {"completion_tokens": 3}}'),
    }
    with fake_server(factor_on={"5": 50, "6": 0}, raw_on=raw) as s:
        rec, _ = run_served(make_workload(_workload((4, 5, 6, 7, 8))), tmp_path,
                            {"endpoint": s.endpoint})
    rows = _rows(rec)
    assert rows[4].status == "ok" and rec.status == "ok"
    assert rows[5].reason.startswith("bad reply: sample 0 streamed more than the 5 tokens")
    assert rows[6].reason == "wrong length: the reply carried no tokens"
    assert rows[7].reason == ("wrong length: the server's usage counts 9 completion tokens, "
                              "7 were streamed")
    assert rows[8].reason.startswith("wrong length: 3 tokens streamed for 1 x max_tokens 8")
    # The long stream was cut where it overran: no 50x throughput.
    assert rec.summary["completed"] == 1
    assert rec.summary["total_output_tokens"] <= 4 + 5 + 7 + 3


def test_the_run_deadline_fails_what_is_unfinished_and_keeps_what_completed(tmp_path) -> None:
    reqs = [*_workload((4, 7, 5)), text_request("late", 30, 3, arrival=60.0)]
    with fake_server(hang_on=["7"]) as s:
        rec, plan = run_served(make_workload(reqs), tmp_path,
                               {"endpoint": s.endpoint, "run_timeout_s": 2.0})
    assert rec.status == "failed"
    assert "the run passed run_timeout_s = 2 s: 1 request in flight failed" in rec.error
    rows = {r.id: r for r in rec.requests}
    assert rows["r0"].status == rows["r2"].status == "ok"
    assert rows["r1"].reason == "run timeout: the run passed run_timeout_s = 2 s"
    assert rows["late"].status == "unfinished"
    assert load_record(plan.out_dir / "served.json").summary["completed"] == 2
    assert rec.engine_config["run_timeout_s"] == 2.0


# -- redirects ----------------------------------------------------------------------------

def test_a_redirect_to_another_host_is_refused_at_discovery(tmp_path) -> None:
    with fake_server(redirect={"host": "localhost", "paths": ["/v1/models"]}) as s, \
            pytest.raises(KvbenchError, match=r"redirected to another host \(http://localhost:"
                          r".*allow_redirects_to_other_hosts = true"):
        plan_served(make_workload(_workload((4,))), tmp_path, {"endpoint": s.endpoint})


def test_a_redirect_to_another_host_is_refused_mid_run(tmp_path) -> None:
    with fake_server(redirect={"host": "localhost", "paths": ["/v1/completions"]}) as s:
        rec, _ = run_served(make_workload(_workload((4, 5))), tmp_path,
                            {"endpoint": s.endpoint})
        log = s.log()
    assert log == []  # no completion was asked of anyone
    assert rec.status == "failed"
    assert rec.error.startswith("all 2 requests failed; the first, r0: redirect refused: ")
    assert all("redirected to another host" in r.reason for r in rec.requests)


def test_allowed_redirects_are_followed_and_named_without_the_key(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    paths = ["/v1/models", "/v1/completions", "/metrics"]
    with fake_server(redirect={"host": "localhost", "paths": paths}) as s:
        rec, _ = run_served(make_workload(_workload((4, 5))), tmp_path,
                            {"endpoint": s.endpoint, "api_key_env": KEY_ENV,
                             "allow_redirects_to_other_hosts": True})
        log = s.log()
    assert rec.status == "ok" and rec.summary["completed"] == 2
    # The key stays with the host it was meant for.
    assert {(e["host"], e["authorization"]) for e in log} == {("localhost", None)}
    origin = f"http://127.0.0.1:{s.port}"
    expected = {f"{origin}/v1/completions": f"http://localhost:{s.port}/v1/completions?hop=1"}
    assert rec.engine_config["observed"]["redirects"] == {
        **expected, f"{origin}/metrics": f"http://localhost:{s.port}/metrics?hop=1"}
    assert rec.engine_config["server"]["redirects"][f"{origin}/v1/models"] == (
        f"http://localhost:{s.port}/v1/models?hop=1")
    assert rec.engine_config["scrapes"]["failed"] == 0


def test_redirects_within_the_host_need_no_permission(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with fake_server(api_key=KEY, redirect={"paths": ["/v1/completions"]}) as s:
        rec, _ = run_served(make_workload(_workload((4,))), tmp_path,
                            {"endpoint": s.endpoint, "api_key_env": KEY_ENV})
    assert rec.status == "ok", rec.error
    assert list(rec.engine_config["observed"]["redirects"].values()) == [
        f"http://127.0.0.1:{s.port}/v1/completions?hop=1"]


# -- /metrics -----------------------------------------------------------------------------

INFO = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size="32",'
        'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None"}} 1.0\n'
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n')


@pytest.mark.parametrize(("server", "warning"), [
    ({"metrics_page": "vllm:num_requests_running{engine=\"0\" 1\n"}, "cannot be read"),
    ({"metrics_page": INFO.format(blocks="9" * 5000)}, "absurd values for capacity_blocks"),
    ({"metrics_page": "# TYPE sglang:max_total_num_tokens gauge\n"
                      "sglang:max_total_num_tokens +Inf\n"}, "absurd values for capacity_tokens"),
    ({"metrics_series": 20_000}, "more than 10000 series"),
    ({"metrics_series": 1_000_000}, "over the 8388608 bytes read"),
], ids=["unparseable", "5000-digit-blocks", "inf-capacity", "many-series", "huge-page"])
def test_hostile_metrics_degrade_the_run_with_the_named_warning(
        tmp_path, server: dict[str, Any], warning: str) -> None:
    with fake_server(**server) as s:
        plan = plan_served(make_workload(_workload((4,))), tmp_path, {"endpoint": s.endpoint})
    warnings = [w for w in plan.warnings if "no-server-metrics:" in w]
    assert any(warning in w for w in warnings), plan.warnings


def test_a_run_with_unreadable_metrics_goes_on_without_telemetry(tmp_path) -> None:
    with fake_server(metrics_page="vllm:kv_cache_usage_perc{} \n") as s:
        rec, _ = run_served(make_workload(_workload((4, 5))), tmp_path, {"endpoint": s.endpoint})
    assert rec.status == "ok" and rec.summary["completed"] == 2
    assert rec.engine_config["server_metrics"]["status"].startswith("unreadable: ")
    assert rec.summary["kv_capacity_bytes"] is None


def test_non_finite_gauges_mid_run_are_dropped_not_fatal(tmp_path) -> None:
    with fake_server(nan_while_busy=True, first_token_delay_s=0.2) as s:
        rec, _ = run_served(make_workload(_workload((4, 5, 6))), tmp_path,
                            {"endpoint": s.endpoint, "scrape_interval_ms": 20,
                             "scrape_max_duty": 1.0})
    assert rec.status == "ok", rec.error
    assert rec.summary["completed"] == 3
    dropped = rec.engine_config["scrapes"]["values_dropped"]
    assert dropped["usage"] >= 1 and dropped["running"] >= 1
    # Readings before and after the requests held real numbers.
    assert rec.summary["kv_capacity_bytes"] == 64 * 32 * 2048
    assert rec.curves["kv_reserved_bytes"][-1] == 0
