"""The peers' comparison against the server's own clock, on made-up readings: the histogram
parse, the per-tool deltas and the ratios the served tests assert (no server needed)."""

from __future__ import annotations

import peers
import pytest
from peers import Samples, off_the_clocks, paced_ratios, paces, ratios, server_histograms

# Two engine series of each histogram (sums in seconds), as a vLLM server with two engines
# publishes them; buckets are not read.
_METRICS = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf"}} {n0}
vllm:time_to_first_token_seconds_count{{engine="0"}} {n0}
vllm:time_to_first_token_seconds_sum{{engine="0"}} {ttft0}
vllm:time_to_first_token_seconds_count{{engine="1"}} {n1}
vllm:time_to_first_token_seconds_sum{{engine="1"}} {ttft1}
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_count{{engine="0"}} {n0}
vllm:request_time_per_output_token_seconds_sum{{engine="0"}} {tpot0}
vllm:request_time_per_output_token_seconds_count{{engine="1"}} {n1}
vllm:request_time_per_output_token_seconds_sum{{engine="1"}} {tpot1}
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_count{{engine="0"}} {g0}
vllm:inter_token_latency_seconds_sum{{engine="0"}} {itl0}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} 0.0
"""


class _Server:
    base_url = "http://127.0.0.1:1"


def _serve(monkeypatch: pytest.MonkeyPatch, **values: float) -> None:
    body = _METRICS.format(**values).encode()
    monkeypatch.setattr(peers, "get_url", lambda url: (200, body))


def test_histograms_are_summed_over_engines_in_ms(monkeypatch) -> None:
    _serve(monkeypatch, n0=3, n1=1, ttft0=0.15, ttft1=0.05, tpot0=0.018, tpot1=0.006,
           g0=90, itl0=0.54)
    h = server_histograms(_Server())  # type: ignore[arg-type]
    assert h["ttft"] == pytest.approx([200.0, 4])
    assert h["tpot"] == pytest.approx([24.0, 4])
    assert h["itl"] == pytest.approx([540.0, 90])


def test_a_server_without_metrics_fails_the_reading(monkeypatch) -> None:
    monkeypatch.setattr(peers, "get_url", lambda url: (404, b"not found"))
    with pytest.raises(RuntimeError, match="HTTP 404"):
        server_histograms(_Server())  # type: ignore[arg-type]


def _tool(ttft_ms: list[float], tpot_ms: list[float], server_ttft_ms: float,
          server_tpot_ms: float) -> Samples:
    """A tool's samples of one round and the server's readings around it (ITL as TPOT)."""
    n = len(ttft_ms)
    s = Samples(ttft_ms, tpot_ms, list(tpot_ms), n)
    before = {"ttft": [1000.0, 10], "tpot": [50.0, 10], "itl": [50.0, 10]}
    after = {"ttft": [1000.0 + n * server_ttft_ms, 10 + n],
             "tpot": [50.0 + n * server_tpot_ms, 10 + n],
             "itl": [50.0 + n * server_tpot_ms, 10 + n]}
    s.clocked_by(before, after)
    return s


def _pooled(*rounds: Samples) -> Samples:
    pooled = Samples()
    for r in rounds:
        pooled.extend(r)
    return pooled


def test_the_servers_pace_is_divided_out() -> None:
    # The server took 20% longer over the peer's requests, and both clients add the same
    # 5% to what it did: the raw ratio shows the server, the paced one the clients.
    kv = _pooled(_tool([52.5, 52.5], [6.3, 6.3], 50.0, 6.0))
    peer = _pooled(_tool([63.0, 63.0], [7.56, 7.56], 60.0, 7.2))
    pooled = {"kvbench": kv, "peer": peer}
    assert ratios(pooled)["peer"]["ttft"] == pytest.approx(52.5 / 63.0)
    assert paces(pooled)["peer"] == pytest.approx({"ttft": 50 / 60, "tpot": 6 / 7.2,
                                                   "itl": 6 / 7.2})
    assert paced_ratios(pooled)["peer"] == pytest.approx({"ttft": 1.0, "tpot": 1.0,
                                                          "itl": 1.0})
    # A client that adds more than the other shows in the paced ratio.
    slow = _pooled(_tool([66.0, 66.0], [7.56, 7.56], 60.0, 7.2))
    assert paced_ratios({"kvbench": kv, "peer": slow})["peer"]["ttft"] == pytest.approx(
        (52.5 / 50.0) / (66.0 / 60.0))


def test_kvbench_agrees_with_the_peer_or_with_the_server() -> None:
    def off(kv_ttft: float, peer_ttft: float) -> dict:
        # The server took 30 ms over either tool's requests; TPOT and ITL agree exactly.
        pooled = {"kvbench": _pooled(_tool([kv_ttft], [6.0], 30.0, 6.0)),
                  "peer": _pooled(_tool([peer_ttft], [6.0], 30.0, 6.0))}
        return off_the_clocks(pooled, "peer", ["ttft", "tpot", "itl"], 0.10)

    assert off(31.0, 33.0) == {}  # within 10% of the peer
    # The peer's client added 15% to the server's 30 ms, kvbench's 1%: paced 0.88, but
    # kvbench is nearer the server's clock, so it is not kvbench's error.
    assert off(30.3, 34.5) == {}
    assert off(28.0, 34.5) == {}  # 7% under the server, within the 10% slack
    # Under the server's figure by more than the slack, or over both: kvbench is off.
    assert off(26.0, 34.5) == {"ttft": pytest.approx((26 / 30, 34.5 / 30))}
    assert off(40.0, 34.5) == {"ttft": pytest.approx((40 / 30, 34.5 / 30))}
    assert off(34.5, 30.0)["ttft"] == pytest.approx((1.15, 1.0))
    # Missing server figures for either tool: off, with None in its place.
    kv = _pooled(_tool([30.0], [6.0], 30.0, 6.0))
    bare = Samples([30.0], [6.0], [6.0], 1)
    assert off_the_clocks({"kvbench": kv, "peer": bare}, "peer", ["ttft"], 0.1) == {
        "ttft": (pytest.approx(1.0), None)}


def test_other_traffic_drops_the_servers_figures() -> None:
    s = Samples([50.0, 50.0], [6.0, 6.0], [6.0], 2)
    # Three requests' observations for a tool that sent two: someone else's request came.
    s.clocked_by({"ttft": [0.0, 0], "tpot": [0.0, 0], "itl": [0.0, 0]},
                 {"ttft": [150.0, 3], "tpot": [18.0, 3], "itl": [18.0, 3]})
    assert s.server is None
    # Pooled with a clean round, the tool has no server figures at all, and no paced ratio.
    pooled = _pooled(_tool([50.0], [6.0], 50.0, 6.0), s)
    assert pooled.server is None and pooled.server_mean("ttft") is None
    peer = _pooled(_tool([50.0], [6.0], 50.0, 6.0))
    assert paced_ratios({"kvbench": pooled, "peer": peer})["peer"]["ttft"] is None
    # Per-round figures keep what each round had.
    assert pooled.rounds[0]["server_ttft"] == pytest.approx(50.0)
    assert pooled.rounds[1]["server_ttft"] is None


def _cutting(monkeypatch: pytest.MonkeyPatch, cut: int) -> tuple[list[int], peers.Tool]:
    """A tool that cuts its first ``cut`` tries short, and the list of rounds it ran."""
    _serve(monkeypatch, n0=0, n1=0, ttft0=0, ttft1=0, tpot0=0, tpot1=0, g0=0, itl0=0)
    ran: list[int] = []

    def tool(server, folder, k: int) -> Samples:
        ran.append(k)
        if len(ran) <= cut:
            raise peers.CutShort("completed 5 of 16 requests")
        return Samples([50.0], [6.0], [6.0], 1)

    return ran, tool


def test_a_round_a_peer_cut_short_is_run_again(monkeypatch, tmp_path) -> None:
    ran, tool = _cutting(monkeypatch, cut=peers.CUT_SHORT_RETRIES)
    pooled = peers.interleaved(_Server(), tmp_path, {"peer": tool}, rounds=1, warmup=0)
    assert ran == [0] * (peers.CUT_SHORT_RETRIES + 1)
    assert pooled["peer"].ttft == [50.0]


def test_a_peer_that_always_cuts_short_fails_the_test(monkeypatch, tmp_path) -> None:
    tries = peers.CUT_SHORT_RETRIES + 1
    ran, tool = _cutting(monkeypatch, cut=tries)
    with pytest.raises(RuntimeError, match=rf"5 of 16 requests, in each of {tries} tries"):
        peers.interleaved(_Server(), tmp_path, {"peer": tool}, rounds=1, warmup=0)
    assert len(ran) == tries


def test_a_stalled_round_is_named() -> None:
    from served import stalled

    steady, hiccup = Samples(), Samples()
    steady.rounds = [{"ttft": t} for t in (27.4, 25.2, 24.4, 24.2, 25.2, 26.2)]
    hiccup.rounds = [{"ttft": t} for t in (25.3, 29.9, 27.3, 91.1, 24.9, 27.7)]
    assert stalled({"vllm bench serve": steady}) is None
    assert "a round of kvbench stalled (median TTFT 91.1 ms" in stalled(
        {"vllm bench serve": steady, "kvbench": hiccup})
