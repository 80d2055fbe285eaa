"""The openai engine against a fake server on 127.0.0.1: records, server telemetry, and the
error paths (unreachable, wrong model, wrong key, no metrics, HTTP errors, timeouts, a
server dying mid-run). Against real vLLM: tests/vllm/test_served.py."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
from fake_openai import fake_server, plan_served, run_served

from helpers import make_workload, text_request
from kvbench.errors import KvbenchError
from kvbench.results.schema import load_record
from kvbench.workloads.model import Request, Segment

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

BLOCK_BYTES = 32 * 2048  # the fake's 32-token blocks at the tiny preset's bytes per token


def _workload(outputs: tuple[int, ...] = (4, 6, 8, 10, 12, 9)) -> list[Request]:
    return [text_request(f"r{i}", 40 + 11 * i, out, arrival=0.01 * i)
            for i, out in enumerate(outputs)]


@pytest.fixture(scope="module")
def server():
    # Requests stay in flight for 200 ms before their first token: many scrapes see them.
    with fake_server(first_token_delay_s=0.2) as s:
        yield s


@pytest.fixture(scope="module")
def record(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    rec, _ = run_served(make_workload(_workload()), tmp,
                        {"endpoint": server.endpoint, "scrape_interval_ms": 20,
                         "scrape_max_duty": 1.0})
    return rec


def test_every_request_streams_exactly_its_tokens(record) -> None:
    assert record.status == "ok", record.error
    s = record.summary
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(_workload_outputs())
    obs = record.engine_config["observed"]
    assert obs["usage_check"] == {
        "checked": 6, "usage_missing": 0, "prompt_token_mismatches": 0,
        "output_token_mismatches": 0, "streamed_token_mismatches": 0,
    }
    assert obs["requests"]["prompt_format"] == {"token_ids": 6}
    # The fake waits 200 ms before the first token: TTFT can only be longer.
    assert all(r.ttft_ms >= 200.0 for r in record.requests)
    assert all(r.output_digest for r in record.requests)


def _workload_outputs() -> list[int]:
    return [r.output_tokens for r in _workload()]


def test_the_record_carries_the_servers_kv_curves_and_drains_to_zero(record) -> None:
    s, c = record.summary, record.curves
    assert s["kv_capacity_bytes"] == 64 * BLOCK_BYTES
    assert s["peak_kv_reserved_bytes"] >= BLOCK_BYTES
    assert s["peak_kv_reserved_bytes"] % BLOCK_BYTES == 0
    # The drained server holds nothing: the last reading was taken after the drain.
    assert s["kv_retained_bytes"] == 0
    assert c["kv_reserved_bytes"][-1] == 0
    # What vLLM's metrics do not say stays absent.
    assert s["peak_kv_used_bytes"] is None and s["mean_kv_utilization"] is None
    assert "kv_used_bytes" not in c
    assert record.engine_config["server"]["flavor"] == "vllm"
    assert record.engine_config["scrapes"]["count"] >= 2
    # The fake counts every prompt token as a prefix-cache query and never hits.
    assert s["prefix_hit_rate"] == 0.0


def test_server_telemetry_reads_the_servers_process(server, tmp_path) -> None:
    rec, _ = run_served(
        make_workload(_workload()[:2]), tmp_path,
        {"endpoint": server.endpoint, "server_pid": server.proc.pid},
    )
    assert rec.telemetry.probes["rss"] == "ok"
    assert rec.telemetry.facts["rss"]["pid"] == server.proc.pid
    assert rec.summary["peak_rss_bytes"] > 0
    assert rec.telemetry.probes["nvml"] == "unavailable: gpu_index not given"


def test_an_unreachable_endpoint_fails_before_work(tmp_path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(KvbenchError, match=r"cannot reach the server at http://127\.0\.0\.1:\d+/v1"):
        plan_served(make_workload(_workload()), tmp_path, {"endpoint": endpoint})


def test_a_wrong_model_name_fails_with_the_served_ones(server, tmp_path) -> None:
    with pytest.raises(KvbenchError, match=r"does not serve 'llama'; it serves fake-model"):
        plan_served(make_workload(_workload()), tmp_path,
                    {"endpoint": server.endpoint, "served_model": "llama"})


def test_the_virtual_clock_is_refused(server, tmp_path) -> None:
    with pytest.raises(KvbenchError, match="live server in real time: use --clock wall"):
        plan_served(make_workload(_workload()), tmp_path, {"endpoint": server.endpoint},
                    clock="virtual")


def test_requests_longer_than_the_servers_context_are_rejected(server, tmp_path) -> None:
    reqs = [*_workload()[:2], text_request("long", 500, 20)]
    plan = plan_served(make_workload(reqs), tmp_path, {"endpoint": server.endpoint})
    assert any("reject 1 of 3" in w and "max_model_len 512" in w for w in plan.warnings)


def test_the_api_key_is_sent_but_never_written(tmp_path, monkeypatch, capsys) -> None:
    key = "sk-kvbench-test-7f3a91"
    with fake_server(api_key=key) as s:
        section = {"endpoint": s.endpoint, "api_key_env": "KVBENCH_TEST_KEY"}
        with pytest.raises(KvbenchError, match="KVBENCH_TEST_KEY, which is not set"):
            plan_served(make_workload(_workload()), tmp_path, section)
        monkeypatch.setenv("KVBENCH_TEST_KEY", "wrong")
        with pytest.raises(KvbenchError, match=r"HTTP 401.*KVBENCH_TEST_KEY is not accepted"):
            plan_served(make_workload(_workload()), tmp_path, section)
        monkeypatch.setenv("KVBENCH_TEST_KEY", key)
        rec, plan = run_served(make_workload(_workload()), tmp_path, section)
        log = s.log()
    assert rec.status == "ok" and rec.summary["completed"] == 6
    assert {entry["authorization"] for entry in log} == {f"Bearer {key}"}
    written = "".join(p.read_text() for p in plan.out_dir.iterdir() if p.suffix in (".json", ".md"))
    assert "KVBENCH_TEST_KEY" in written and key not in written
    out = capsys.readouterr()
    assert key not in out.out + out.err
    assert rec.engine_config["api_key_env"] == "KVBENCH_TEST_KEY"


def test_a_server_without_metrics_degrades_with_a_named_warning(tmp_path) -> None:
    with fake_server(metrics="none") as s:
        rec, plan = run_served(make_workload(_workload()), tmp_path, {"endpoint": s.endpoint})
    assert any(w.startswith("engine 'served': no-server-metrics:") for w in plan.warnings)
    assert rec.status == "ok" and rec.summary["completed"] == 6
    assert rec.engine_config["server_metrics"]["status"].startswith("unavailable: GET ")
    assert rec.engine_config["warnings"][0].startswith("no-server-metrics:")
    assert rec.summary["kv_capacity_bytes"] is None and "kv_reserved_bytes" not in rec.curves
    # Without the server's gauges, running is what the client has in flight.
    assert rec.summary["max_concurrent_requests"] >= 1


def test_metrics_of_another_kind_degrade_too(tmp_path) -> None:
    with fake_server(metrics="junk") as s:
        plan = plan_served(make_workload(_workload()), tmp_path, {"endpoint": s.endpoint})
    assert any("unknown-server-metrics:" in w for w in plan.warnings)


def test_sglang_metrics_give_token_granular_kv(tmp_path) -> None:
    with fake_server(metrics="sglang", first_token_delay_s=0.2) as s:
        rec, _ = run_served(make_workload(_workload()), tmp_path,
                            {"endpoint": s.endpoint, "scrape_interval_ms": 20,
                             "scrape_max_duty": 1.0})
    assert rec.status == "ok"
    assert rec.engine_config["server"]["flavor"] == "sglang"
    assert rec.summary["kv_capacity_bytes"] == 64 * BLOCK_BYTES
    # num_used_tokens: whole tokens of 2048 bytes, not blocks.
    assert rec.summary["peak_kv_reserved_bytes"] % 2048 == 0
    assert rec.summary["peak_kv_reserved_bytes"] > 0
    assert rec.summary["prefix_hit_rate"] is None  # SGLang publishes a rate, not counters
    assert rec.engine_config["server_counters"]["cache_hit_rate"] == 0.25


def test_offload_tiers_of_a_served_engine(tmp_path) -> None:
    with fake_server(offload=True) as s:
        rec, _ = run_served(make_workload(_workload()), tmp_path, {"endpoint": s.endpoint})
    assert rec.status == "ok"
    summary = rec.summary
    queried = sum(40 + 11 * i for i in range(6))
    # The fake serves half of what is looked up from CPU memory, at 1 GB/s.
    assert summary["offload_hit_tokens"] == queried // 2
    assert summary["offload_hit_rate"] == pytest.approx(0.5, abs=1 / queried)
    assert summary["offload_loaded_bytes"] == queried * 1024
    assert summary["offload_load_gbps"] == pytest.approx(1.0)
    assert summary["offload_used_bytes"] == 6 * 4096
    # Not published: absent, not zero.
    assert summary["offload_stored_bytes"] is None and summary["offload_store_gbps"] is None
    assert summary["offload_cpu_hit_rate"] is None  # LMCache's gauge holds bytes, not hits
    # LMCache's CPU bytes, read over the run into the tier's curve.
    held = rec.curves["offload_cpu_used_bytes"]
    assert held[-1] == 6 * 4096 and held == sorted(held)
    assert "offload_disk_used_bytes" not in rec.curves


def test_http_errors_and_timeouts_fail_only_their_requests(tmp_path) -> None:
    reqs = _workload((4, 5, 7, 3, 8, 9))
    with fake_server(status_on={"5": 503, "3": 400}, hang_on=["7"]) as s:
        rec, _ = run_served(make_workload(reqs), tmp_path,
                            {"endpoint": s.endpoint, "request_timeout_s": 0.5})
    assert rec.status == "ok", rec.error
    rows = {r.id: r for r in rec.requests}
    assert rows["r1"].status == "failed" and rows["r1"].reason.startswith("HTTP 503")
    assert "scripted 503" in rows["r1"].reason
    assert rows["r3"].status == "failed" and rows["r3"].reason.startswith("HTTP 400")
    assert rows["r2"].status == "failed" and rows["r2"].reason == "timeout after 0.5 s"
    assert {r.status for i, r in rows.items() if i in ("r0", "r4", "r5")} == {"ok"}
    s = rec.summary
    assert s["completed"] == 3 and s["failed"] == 3
    assert rec.engine_config["observed"]["errors"] == {
        "HTTP 503 Service Unavailable": 1, "HTTP 400 Bad Request": 1, "timeout after 0.5 s": 1,
    }


def test_a_server_dying_mid_run_fails_the_run_and_keeps_what_completed(tmp_path) -> None:
    # Four short requests complete, then the server dies in the middle of a long one.
    reqs = [text_request(f"r{i}", 30, 3, arrival=0.0) for i in range(4)]
    reqs += [text_request("long", 30, 40, arrival=0.3), text_request("late", 30, 5, arrival=0.6)]
    with fake_server(die_after_tokens=4 * 3 + 10, token_delay_s=0.01) as s:
        rec, plan = run_served(make_workload(reqs), tmp_path, {"endpoint": s.endpoint})
    assert rec.status == "failed"
    assert "stopped answering mid-run" in rec.error and "connection lost" in rec.error
    rows = {r.id: r for r in rec.requests}
    assert all(rows[f"r{i}"].status == "ok" for i in range(4))
    assert rows["long"].status == "failed"
    assert rows["late"].status == "unfinished"
    assert load_record(plan.out_dir / "served.json").summary["completed"] == 4


def test_usage_mismatches_are_counted(tmp_path) -> None:
    with fake_server(usage_off_by=1) as s:
        rec, _ = run_served(make_workload(_workload()), tmp_path, {"endpoint": s.endpoint})
    check = rec.engine_config["observed"]["usage_check"]
    assert check["streamed_token_mismatches"] == 6 and check["output_token_mismatches"] == 0


def test_text_prompts_have_one_word_per_token(tmp_path) -> None:
    with fake_server(no_token_ids=True) as s:
        rec, _ = run_served(make_workload(_workload()), tmp_path,
                            {"endpoint": s.endpoint, "prompt_format": "text"})
        log = s.log()
    assert rec.summary["completed"] == 6
    prompts = sorted(len(e["body"]["prompt"].split()) for e in log)
    assert prompts == sorted(r.prompt_tokens for r in _workload())
    assert all(e["body"]["add_special_tokens"] is False for e in log)
    # Without token ids each chunk counts as one token and outputs have no digest.
    assert rec.summary["total_output_tokens"] == sum(_workload_outputs())
    assert all(r.output_digest is None for r in rec.requests)
    assert rec.engine_config["observed"]["requests"]["prompt_format"] == {"text": 6}


def _image_request() -> Request:
    return Request("img", 0.0, (
        Segment("text", 12, "t/q"),
        Segment("image", 577, "img/a", height=336, width=336, rule="vit-l14"),
        Segment("text", 5, "t/tail"),
    ), output_tokens=4)


def test_images_go_as_pngs_of_their_size_through_chat(tmp_path) -> None:
    PIL = pytest.importorskip("PIL.Image")
    import base64

    reqs = [_image_request(), text_request("txt", 30, 4, arrival=0.01)]
    with fake_server(max_model_len=2048) as s:
        rec, _ = run_served(make_workload(reqs), tmp_path,
                            {"endpoint": s.endpoint, "multimodal": "images"})
        log = {e["path"]: e["body"] for e in s.log()}
    assert rec.summary["completed"] == 2
    parts = log["/v1/chat/completions"]["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text"]
    assert len(parts[0]["text"].split()) == 12 and len(parts[2]["text"].split()) == 5
    url = parts[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    image = PIL.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.size == (336, 336) and image.mode == "RGB"
    assert isinstance(log["/v1/completions"]["prompt"], list)
    observed = rec.engine_config["observed"]["requests"]
    assert observed["api"] == {"chat": 1, "completions": 1} and observed["images_sent"] == 1


def test_without_images_multimodal_segments_are_placeholder_ids(server, tmp_path) -> None:
    with fake_server(max_model_len=2048) as s:
        rec, _ = run_served(make_workload([_image_request()]), tmp_path, {"endpoint": s.endpoint})
        [entry] = s.log()
    assert len(entry["body"]["prompt"]) == 12 + 577 + 5
    assert rec.engine_config["observed"]["requests"]["multimodal_placeholders"] == 1
    assert rec.engine_config["observed"]["usage_check"]["prompt_token_mismatches"] == 0


def test_soak_waves_through_one_server(server, tmp_path) -> None:
    from kvbench.tools.soak import run_soak

    plan = plan_served(make_workload(_workload()[:3]), tmp_path, {"endpoint": server.endpoint})
    [rec] = run_soak(plan, 2, 10.0, 1 << 20)
    assert rec.status == "ok" and rec.summary["completed"] == 6
    kv_after = [w.memory.get("kv_reserved_bytes") for w in rec.soak.per_wave]
    assert kv_after == [0, 0]
    assert not rec.soak.leak_detected
    json.dumps(rec.model_dump())  # the record is JSON-able


def _suite_file(tmp: Path, endpoint: str) -> Path:
    from kvbench.workloads.io import save_workload

    save_workload(make_workload(_workload()[:2]), tmp / "wl.jsonl")
    path = tmp / "served.toml"
    path.write_text(
        'name = "served"\n[workload]\nfile = "wl.jsonl"\n[run]\ndevice = "cpu"\n'
        f'[engines.live]\nkind = "openai"\nendpoint = "{endpoint}"\n'
    )
    return path


def test_kvbench_run_drives_a_server_from_a_suite_file(server, tmp_path) -> None:
    from typer.testing import CliRunner

    from kvbench.cli.app import app

    suite = _suite_file(tmp_path, server.endpoint)
    result = CliRunner().invoke(app, ["run", str(suite), "--engines", "live",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rec = load_record(tmp_path / "out" / "live.json")
    assert rec.status == "ok" and rec.summary["completed"] == 2
    assert rec.engine_config["kind"] == "openai"


def test_the_section_validates_urls(tmp_path: Path) -> None:
    from kvbench.errors import InputFileError
    from kvbench.run.suite import load_suite

    with pytest.raises(InputFileError, match="is not an http"):
        load_suite(str(_suite_file(tmp_path, "127.0.0.1:8000")))


def test_requests_held_back_by_max_concurrency_are_not_delayed_by_drain_readings(
        server, tmp_path) -> None:
    # One request in flight at a time: the client empties after each, and the harness sends
    # the next straight away. /metrics is read drained once, at the end, not between them
    # (a reading costs the server time while it serves the next request).
    reqs = [text_request(f"c{i}", 40, 4) for i in range(5)]
    rec, _ = run_served(make_workload(reqs), tmp_path,
                        {"endpoint": server.endpoint, "scrape_interval_ms": 3_600_000.0},
                        max_concurrency=1)
    assert rec.status == "ok" and rec.summary["completed"] == 5
    # The reading before the run, the first periodic one, and the drained one at the end
    # (or two, when the fake's gauges still showed the last request); not one per request.
    assert rec.engine_config["scrapes"]["count"] <= 4
    assert rec.curves["kv_reserved_bytes"][-1] == 0
