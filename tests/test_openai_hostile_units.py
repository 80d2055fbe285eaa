"""The served engine's defences as functions: secret scrubbing, server-sent events split any
way, chunk and usage validation, and /metrics pages with hostile values. The same paths
against a live fake server: tests/test_openai_hostile.py."""

from __future__ import annotations

import json

import pytest

from kvbench.engines.external.openai.reply import Ask, BadReply, Reply, SseReader, parse_usage
from kvbench.engines.external.openai.scrub import scrub
from kvbench.engines.external.openai.server_metrics import (
    MAX_SERIES,
    MetricsError,
    ServerKV,
    parse_metrics,
)

pytest.importorskip("prometheus_client")

KEY = "Zq8-not/an\"sk&key+1"


@pytest.mark.parametrize("text", [
    f"bad key {KEY}",
    f"Authorization: Bearer {KEY}",
    f"authorization: bearer {KEY}",
    f'{{"message": "bad key", "header": {json.dumps(KEY)}}}',
    "key=Zq8-not%2Fan%22sk%26key%2B1",
    "Bearer some-other-token-4711",
    "keys look like sk-proj-abcdef123456",
])
def test_secrets_are_scrubbed_in_every_form(text: str) -> None:
    out = scrub(text, KEY)
    assert KEY not in out and "Zq8" not in out
    assert "some-other-token-4711" not in out and "abcdef123456" not in out
    assert "***" in out


def test_text_without_secrets_is_kept() -> None:
    text = "HTTP 503 Service Unavailable: the disk-full task-queue is busy"
    assert scrub(text, KEY) == text
    assert scrub(text, None) == text


def _events(reader: SseReader, *parts: bytes) -> list[bytes]:
    out = []
    for part in parts:
        out += reader.feed(part)
    return out + reader.finish()


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_events_split_on_any_line_end_even_across_reads(sep: bytes) -> None:
    stream = sep.join([b": comment", b"data: a", b"data: b", b"", b"data:[DONE]", b"", b""])
    whole = _events(SseReader(), stream)
    assert whole == [b"a\nb", b"[DONE]"]
    # Every split point, including between the CR and LF of one line end.
    for cut in range(len(stream)):
        assert _events(SseReader(), stream[:cut], stream[cut:]) == whole


def test_an_event_without_its_blank_line_ends_with_the_stream() -> None:
    assert _events(SseReader(), b"data: 1\n\ndata: [DONE]") == [b"1", b"[DONE]"]


@pytest.mark.parametrize("parts", [
    (b"data: " + b"x" * 2048,),  # one unseparated line
    (b"data: " + b"x" * 1000 + b"\n", b"data: " + b"x" * 1100 + b"\n"),  # a long event
])
def test_events_over_the_cap_fail_the_reply(parts: tuple[bytes, ...]) -> None:
    reader = SseReader(max_event_bytes=2000)
    with pytest.raises(BadReply, match="longer than 2000 bytes"):
        for part in parts:
            reader.feed(part)


# One field the client reads, broken: each must fail its reply with a reason naming it.
BROKEN_CHUNKS = {
    "null token id": ({"choices": [{"token_ids": [None]}]}, "token_ids"),
    "float token ids": ({"choices": [{"token_ids": [1.5, 2.0]}]}, "token_ids"),
    "string token ids": ({"choices": [{"token_ids": "12"}]}, "token_ids"),
    "negative token id": ({"choices": [{"token_ids": [-1]}]}, "token_ids"),
    "huge token id": ({"choices": [{"token_ids": [1 << 40]}]}, "token_ids"),
    "boolean token id": ({"choices": [{"token_ids": [True]}]}, "token_ids"),
    "usage string": ({"choices": [], "usage": "lots"}, "usage is a string"),
    "usage list": ({"choices": [], "usage": [1, 2]}, "usage is a list"),
    "details string": ({"usage": {"prompt_tokens_details": "x"}}, "prompt_tokens_details"),
    "cached string": ({"usage": {"prompt_tokens_details": {"cached_tokens": "3"}}},
                      "cached_tokens"),
    "cached beyond prompt": ({"usage": {"prompt_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 3}}},
                             "cached of 2 prompt"),
    "completion string": ({"usage": {"completion_tokens": "4"}}, "completion_tokens"),
    "prompt boolean": ({"usage": {"prompt_tokens": True}}, "prompt_tokens"),
    "completion huge": ({"usage": {"completion_tokens": 10 ** 30}}, "completion_tokens"),
    "choices string": ({"choices": "none"}, "choices is a string"),
    "choice number": ({"choices": [7]}, "a choice is a number"),
    "index string": ({"choices": [{"index": "0", "text": "a"}]}, "choice index"),
    "index beyond n": ({"choices": [{"index": 3, "text": "a"}]}, "choice index 3"),
    "delta string": ({"choices": [{"delta": "hi"}]}, "delta is a string"),
    "content list": ({"choices": [{"delta": {"content": [1]}}]}, "delta.content"),
    "text number": ({"choices": [{"text": 5}]}, "text is a number"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_CHUNKS))
def test_every_field_read_from_a_chunk_is_checked(name: str) -> None:
    chunk, reason = BROKEN_CHUNKS[name]
    with pytest.raises(BadReply, match=f"^bad reply: .*{reason}"):
        Reply(Ask(2, 4)).take(json.dumps(chunk).encode())


@pytest.mark.parametrize("data", [b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe",
                                  b"[" * 100_000, b"1" * 5000])
def test_chunks_that_are_no_json_object_fail_the_reply(data: bytes) -> None:
    with pytest.raises(BadReply, match=r"^bad reply: a chunk is"):
        Reply(Ask(1, 4)).take(data)


def test_an_error_event_fails_with_its_message() -> None:
    with pytest.raises(BadReply, match=r"^error event: overloaded$"):
        Reply(Ask(1, 4)).take(b'{"error": {"message": "overloaded"}}')


def test_a_sample_streaming_more_than_asked_fails_at_once() -> None:
    reply = Reply(Ask(2, 3))
    assert reply.take(b'{"choices": [{"index": 1, "token_ids": [1, 2, 3]}]}')[0].count == 3
    with pytest.raises(BadReply, match="sample 1 streamed more than the 3 tokens"):
        reply.take(b'{"choices": [{"index": 1, "token_ids": [4]}]}')


def test_good_chunks_count_ids_text_and_content() -> None:
    reply = Reply(Ask(2, 4))
    reply.take(b'{"choices": [{"index": 0, "token_ids": [5, 6]}, {"index": 1, "text": "a"}]}')
    # A chunk with only a role, an empty text or a finish reason carries no token.
    reply.take(b'{"choices": [{"index": 1, "delta": {"role": "assistant"}}, '
               b'{"index": 0, "text": "", "finish_reason": "length"}]}')
    reply.take(b'{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, '
               b'"prompt_tokens_details": {"cached_tokens": 4}}}')
    reply.take(b" [DONE] ")
    assert reply.counts == [2, 1] and reply.done
    assert reply.usage == parse_usage({"prompt_tokens": 9, "completion_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 4}})


VLLM_INFO = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size="16",'
             'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None"}} 1.0\n')


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3", "1e300"])
def test_non_finite_or_absurd_gauges_are_dropped(value: str) -> None:
    page = ("# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {value}\n'
            'vllm:num_requests_running{engine="1"} 2\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n"
            + VLLM_INFO.format(blocks=64))
    s = parse_metrics(page)
    # One engine's bad series spoils the sum: absent, not a wrong number.
    assert s.running is None and s.dropped == ("running",)
    assert s.usage == 0.5 and s.capacity_blocks == 64
    assert "running" not in s.present() and "dropped" not in s.present()


def test_a_usage_fraction_above_one_is_dropped() -> None:
    s = parse_metrics("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 7\n")
    assert s.usage is None and s.dropped == ("usage",)


def test_absurd_pool_sizes_leave_capacity_unknown() -> None:
    s = parse_metrics(VLLM_INFO.format(blocks="9" * 5000))
    assert s.capacity_blocks is None and s.dropped == ("capacity_blocks",)
    # Within the label bound, but a pool of more than a PiB at this preset's bytes per token.
    big = parse_metrics(VLLM_INFO.format(blocks=1 << 39))
    assert big.capacity_blocks == 1 << 39
    assert ServerKV.of(big, 2048).capacity_bytes is None
    inf = parse_metrics("# TYPE sglang:max_total_num_tokens gauge\n"
                        "sglang:max_total_num_tokens +Inf\n")
    assert inf.capacity_tokens is None and inf.dropped == ("capacity_tokens",)
    assert ServerKV.of(inf, 2048).capacity_bytes is None


@pytest.mark.parametrize("page", [
    "vllm:num_requests_running{engine=\"0\" 1\n",
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running one\n",
    "vllm:num_requests_running\n",
])
def test_unparseable_pages_raise_metrics_errors(page: str) -> None:
    with pytest.raises(MetricsError, match="not Prometheus text"):
        parse_metrics(page)


def test_too_many_series_are_refused_before_parsing() -> None:
    page = "".join(f'vllm:num_requests_running{{i="{i}"}} 1\n' for i in range(MAX_SERIES + 1))
    with pytest.raises(MetricsError, match=f"more than {MAX_SERIES} series"):
        parse_metrics(page)
    # Lines of other families do not count.
    assert parse_metrics("other 1\n" * (MAX_SERIES + 1)).flavor == "unknown"
