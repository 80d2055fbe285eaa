"""Trace importers: fixtures, the full shared traces, and malformed files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.traces import import_trace

FIXTURES = Path(__file__).parent / "fixtures"
AZURE = FIXTURES / "azure_llm_2023_conv_head500.csv"
MOONCAKE = FIXTURES / "mooncake_synthetic_trace_head300.jsonl"
VOCAB = 32_000


def test_azure_fixture() -> None:
    w = import_trace("azure", AZURE)
    assert len(w) == 500
    first, second = w.requests[:2]
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert first.arrival_s == 0.0 and first.prompt_tokens == 374 and first.output_tokens == 44
    assert second.arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert (second.prompt_tokens, second.output_tokens) == (396, 109)
    assert w.spec["trace"] == "azure" and w.source == str(AZURE)


def test_azure_with_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    p = tmp_path / "bom.csv"
    p.write_bytes(
        b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 18:15:46.6805900,10,2\r\n2023-11-16 18:15:47.0000001,20,3\r\n"
    )
    w = import_trace("azure", p)
    assert [r.prompt_tokens for r in w.requests] == [10, 20]
    assert w.requests[1].arrival_s == pytest.approx(0.3194101, abs=1e-9)


def test_limit_keeps_first_rows() -> None:
    w = import_trace("azure", AZURE, limit=7)
    assert len(w) == 7 and w.requests[:7] == import_trace("azure", AZURE).requests[:7]
    with pytest.raises(KvbenchError, match="limit must be >= 1"):
        import_trace("azure", AZURE, limit=0)


def test_mooncake_fixture_blocks() -> None:
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    w = import_trace("mooncake", MOONCAKE, seed=3)
    assert len(w) == len(rows) == 300
    for row, r in zip(rows, w.requests, strict=True):
        assert r.prompt_tokens == row["input_length"]
        assert r.output_tokens == row["output_length"]
        assert r.arrival_s == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000)
        assert [s.key for s in r.segments] == [f"s3/mooncake/{h}" for h in row["hash_ids"]]
        assert all(s.tokens == 512 for s in r.segments[:-1])


def test_mooncake_equal_leading_hash_ids_share_token_ids() -> None:
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    w = import_trace("mooncake", MOONCAKE)
    by_first: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_first.setdefault(row["hash_ids"][0], []).append(i)
    pairs = [(v[0], v[1]) for v in by_first.values() if len(v) > 1]
    assert pairs, "the fixture should hold requests with a common first block"
    for a, b in pairs[:20]:
        ha, hb = rows[a]["hash_ids"], rows[b]["hash_ids"]
        common = next((k for k, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y),
                      min(len(ha), len(hb)))
        # Full blocks only: the last block of either request may be partial.
        full = min(common, len(ha) - 1, len(hb) - 1)
        ids_a = w.requests[a].prompt_token_ids(VOCAB)
        ids_b = w.requests[b].prompt_token_ids(VOCAB)
        assert np.array_equal(ids_a[: 512 * full], ids_b[: 512 * full])
        if common < min(len(ha), len(hb)):
            lo = 512 * common
            assert not np.array_equal(ids_a[lo : lo + 512], ids_b[lo : lo + 512])


def test_sharegpt_estimates_tokens_from_characters(tmp_path: Path) -> None:
    p = tmp_path / "sharegpt.json"
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "x" * 40},
                                      {"from": "gpt", "value": "y" * 401}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "s"},
                                      {"from": "human", "value": "hi"},
                                      {"from": "human", "value": "again"},
                                      {"from": "gpt", "value": ""}]},
    ]
    p.write_text(json.dumps(data, indent=1))
    w = import_trace("sharegpt", p)
    assert [(r.prompt_tokens, r.output_tokens) for r in w.requests] == [(10, 101), (1, 1)]
    assert all(r.arrival_s == 0.0 for r in w.requests)
    assert w.spec["skipped_conversations"] == 1
    assert import_trace("sharegpt", p, limit=1).requests == w.requests[:1]


def test_full_traces_import(traces_dir: Path) -> None:
    # Import speed is a benchmark's business (benchmarks/asv_bench.py), not a test's.
    for kind, name, count in [
        ("azure", "azure_llm_2023_conv.csv", 19_366),
        ("mooncake", "mooncake_synthetic_trace.jsonl", 3_993),
    ]:
        w = import_trace(kind, traces_dir / name)
        assert len(w) == count
        arrivals = [r.arrival_s for r in w.requests]
        assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
MOONCAKE_OK = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize(
    ("kind", "name", "text", "line", "message"),
    [
        ("azure", "a.csv", "time,in,out\n1,2,3\n", 1, "missing column"),
        ("azure", "a.csv", AZURE_HEAD + "2023-11-16 18:15:47,x,3\n", 3, "ContextTokens must be"),
        ("azure", "a.csv", AZURE_HEAD + "2023-11-16 18:15:47,0,3\n", 3, "ContextTokens must be"),
        ("azure", "a.csv", AZURE_HEAD + "2023-11-16 18:15:47,5,-1\n", 3, "GeneratedTokens"),
        ("azure", "a.csv", AZURE_HEAD + "yesterday,5,1\n", 3, "TIMESTAMP 'yesterday'"),
        ("azure", "a.csv", AZURE_HEAD + "2023-11-16 18:15:47,5\n", 3, "expected 3 columns"),
        ("mooncake", "m.jsonl", MOONCAKE_OK + "{not json\n", 2, "not valid JSON"),
        ("mooncake", "m.jsonl", MOONCAKE_OK + "[1, 2]\n", 2, "JSON object"),
        ("mooncake", "m.jsonl", MOONCAKE_OK * 2 + MOONCAKE_OK.replace("600", "1025"), 3,
         "the last block would hold 513"),
        ("mooncake", "m.jsonl", MOONCAKE_OK.replace("600", "512"), 1,
         "the last block would hold 0"),
        ("mooncake", "m.jsonl", MOONCAKE_OK.replace("[1, 2]", "[]"), 1, "hash_ids must be"),
        ("mooncake", "m.jsonl", MOONCAKE_OK.replace('"timestamp": 0', '"timestamp": -5'), 1,
         "timestamp must be"),
        ("mooncake", "m.jsonl", MOONCAKE_OK.replace('"output_length": 4, ', ""), 1,
         "output_length must be an integer"),
        ("sharegpt", "s.json", '{"conversations": []}', 1, "JSON array"),
        ("sharegpt", "s.json", '[\n  {"conversations": []},\n  {"id": 3}\n]', 3,
         "'conversations' list"),
        ("sharegpt", "s.json", '[\n  {"conversations": [{"from": "human"}]}\n]', 2,
         "string 'from' and 'value'"),
        ("sharegpt", "s.json", '[\n  {"conversations": []}\n  {"conversations": []}\n]', 3,
         "expected ',' or ']'"),
        ("sharegpt", "s.json", '[\n  {"conversations": [}\n]', 2, "not valid JSON"),
    ],
)
def test_malformed_files_name_file_and_line(
    tmp_path: Path, kind: str, name: str, text: str, line: int, message: str
) -> None:
    p = _write(tmp_path, name, text)
    with pytest.raises(InputFileError, match=message) as e:
        import_trace(kind, p)
    assert e.value.line == line
    assert str(e.value).startswith(f"{p}:{line}: ")


def test_missing_file_and_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="no such file"):
        import_trace("azure", tmp_path / "absent.csv")
    with pytest.raises(KvbenchError, match="unknown trace kind 'csv'; valid: azure, azure-lmm, "
                       "mooncake, sharegpt"):
        import_trace("csv", AZURE)
    with pytest.raises(InputFileError, match="no requests found"):
        import_trace("azure", _write(tmp_path, "empty.csv", AZURE_HEAD.splitlines()[0] + "\n"))
