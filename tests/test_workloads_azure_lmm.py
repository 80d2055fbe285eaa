"""The Azure LMM trace importer, on a synthetic file in the published schema."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import pytest
from fixtures.make_azure_lmm_synthetic import synthetic_csv
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.io import load_workload, load_workload_arg, save_workload
from kvbench.workloads.traces import import_trace

LMM = Path(__file__).parent / "fixtures" / "azure_lmm_2025_synthetic.csv"
HEADER = "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"


def _rows() -> list[dict[str, str]]:
    with LMM.open(newline="") as f:
        return list(csv.DictReader(f))


def test_fixture_is_the_documented_procedure() -> None:
    assert LMM.read_text() == synthetic_csv()
    assert len(_rows()) == 400


@pytest.mark.parametrize(("choice", "tokens", "height"), [
    (None, 576, 336), ("llava-1.5", 576, 336), ("qwen2-vl:448x448", 256, 448),
    ("vit-b16:384x384", 577, 384),
])
def test_rows_become_images_then_text(choice: str | None, tokens: int, height: int) -> None:
    rows = _rows()
    w = import_trace("azure-lmm", LMM, seed=4, image_rule=choice)
    t0 = datetime.fromisoformat(rows[0]["TIMESTAMP"].removesuffix("Z"))
    clamped = added = 0
    for i, (row, r) in enumerate(zip(rows, w.requests, strict=True)):
        n, context = int(row["NumImages"]), int(row["ContextTokens"])
        images, text = r.segments[:-1], r.segments[-1]
        assert len(images) == n and all(
            (s.kind, s.tokens, s.height, s.width) == ("image", tokens, height, height)
            for s in images
        )
        assert [s.key for s in images] == [f"s4/azure-lmm/{i}/image/{j}" for j in range(n)]
        assert (text.kind, text.key) == ("text", f"s4/azure-lmm/{i}/text")
        assert text.tokens == max(1, context - n * tokens)
        assert r.output_tokens == int(row["GeneratedTokens"])
        at = datetime.fromisoformat(row["TIMESTAMP"].removesuffix("Z"))
        assert r.arrival_s == pytest.approx((at - t0).total_seconds(), abs=1e-9)
        if context - n * tokens < 1:
            clamped += 1
            added += 1 - (context - n * tokens)
        else:
            assert r.prompt_tokens == context
    assert w.spec["rows_text_clamped"] == clamped
    assert w.spec["tokens_added"] == added
    assert w.spec["images"] == sum(int(r["NumImages"]) for r in rows)
    assert w.spec["image_tokens"] == tokens
    if clamped:
        assert w.warnings == [
            f"{clamped} of 400 rows have fewer ContextTokens than their images take under "
            f"{w.spec['image_rule']} ({tokens} tokens each); their text was set to 1 token, "
            f"adding {added:,} prompt tokens in all"
        ]
    else:
        assert w.warnings == []


def test_llava_needs_clamping_on_this_fixture_and_qwen_does_not() -> None:
    assert import_trace("azure-lmm", LMM).spec["rows_text_clamped"] == 53
    assert import_trace("azure-lmm", LMM, image_rule="qwen2-vl:448x448").spec[
        "rows_text_clamped"] == 0


def test_schema_mismatch(tmp_path: Path) -> None:
    llm = tmp_path / "llm.csv"
    llm.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-10-15T12:00:00.269Z,9,1\n")
    with pytest.raises(InputFileError, match=(
        r"missing column\(s\) NumImages; expected the header "
        r"TIMESTAMP,NumImages,ContextTokens,GeneratedTokens but found "
        r"TIMESTAMP,ContextTokens,GeneratedTokens; with no NumImages this is the Azure LLM "
        r"trace: import it as kind azure$"
    )) as e:
        import_trace("azure-lmm", llm)
    assert e.value.line == 1
    renamed = tmp_path / "renamed.csv"
    renamed.write_text("TIMESTAMP,Images,Context,GeneratedTokens\n2024-10-15T12:00:00Z,1,9,1\n")
    with pytest.raises(InputFileError, match=r"missing column\(s\) NumImages, ContextTokens; "
                       r"expected the header .* but found TIMESTAMP,Images,Context,"
                       r"GeneratedTokens$"):
        import_trace("azure-lmm", renamed)
    no_context = _write(tmp_path, "lmm-no-context.csv",
                        "TIMESTAMP,NumImages,GeneratedTokens\n2024-10-15T12:00:00Z,1,1\n")
    with pytest.raises(InputFileError, match="this is the Azure LMM trace: import it as kind "
                       "azure-lmm"):
        import_trace("azure", no_context)
    as_text = import_trace("azure", LMM)
    assert as_text.warnings == [
        f"{LMM} has a NumImages column (the Azure LMM trace): importing it as azure counts "
        "its image tokens as text; import it as azure-lmm to keep the images"
    ]
    assert [r.prompt_tokens for r in as_text.requests] == [int(r["ContextTokens"])
                                                           for r in _rows()]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2024-10-15T12:00:01Z,-1,9,1", "NumImages must be an integer >= 0"),
        ("2024-10-15T12:00:01Z,two,9,1", "NumImages must be an integer >= 0 .got 'two'."),
        ("2024-10-15T12:00:01Z,1,0,1", "ContextTokens must be an integer >= 1"),
        ("2024-10-15T12:00:01Z,4000000,9,1", r"prompt \(2,304,000,001\) plus output \(1\)"),
        ("2024-10-32T12:00:01Z,1,9,1", "is not a real date"),
    ],
)
def test_bad_rows_name_the_line(tmp_path: Path, row: str, message: str) -> None:
    p = _write(tmp_path, "t.csv", HEADER + "2024-10-15T12:00:00Z,0,9,1\n" + row + "\n")
    with pytest.raises(InputFileError, match=message) as e:
        import_trace("azure-lmm", p)
    assert e.value.line == 3 and str(e.value).startswith(f"{p}:3: ")


def test_image_rule_errors() -> None:
    with pytest.raises(KvbenchError, match="image rule applies only to traces that count "
                       r"images \(azure-lmm\), not to azure"):
        import_trace("azure", LMM, image_rule="llava-1.5")
    with pytest.raises(KvbenchError, match="'qwen2-vl' needs a size"):
        import_trace("azure-lmm", LMM, image_rule="qwen2-vl")


def test_limit_references_and_round_trip(tmp_path: Path) -> None:
    first = import_trace("azure-lmm", LMM, limit=50)
    assert len(first) == 50 and first.spec["rows_text_clamped"] == 7
    assert first.requests == import_trace("azure-lmm", LMM).requests[:50]
    more = import_trace("azure-lmm", LMM, limit=1000, image_rule="qwen2-vl:448x448")
    assert len(more) == 400
    assert more.warnings == [f"asked for 1,000 requests but {LMM} holds 400; using all of them"]
    ref = load_workload_arg(f"azure-lmm:{LMM}", num_requests=50)
    assert ref.digest == first.digest
    assert load_workload(save_workload(first, tmp_path / "w.jsonl")).digest == first.digest


def test_cli_import_with_an_image_rule(tmp_path: Path) -> None:
    out = tmp_path / "lmm.jsonl"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
        "workload", "import", "azure-lmm", str(LMM), "-o", str(out),
        "--image-rule", "qwen2-vl:448x672",
    ])
    assert result.exit_code == 0, result.output
    w = load_workload(out)
    assert w.spec["image_rule"] == "qwen2-vl:448x672" and w.spec["image_tokens"] == 384
    assert {s.rule for r in w.requests for s in r.segments if s.kind == "image"} == {"qwen2-vl"}
