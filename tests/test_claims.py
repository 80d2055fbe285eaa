"""`kvbench claims`: a study for every policy and claim of the field reports, verdicts from
the figures by the rules the rows state, and the quick run end to end on a subset (the whole
quick run is `nox -s claims`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_main import run_main

from kvbench.errors import KvbenchError
from kvbench.tools.claims import STUDIES, parse_only
from kvbench.tools.claims.core import VERDICTS, Row, pick

SEED_CLAIMS = Path(__file__).resolve().parents[2] / "shared" / "SEED-CLAIMS.md"


def test_every_policy_and_claim_has_a_study() -> None:
    expected = {f"P{i}" for i in range(1, 12)} | {f"C{i}" for i in range(1, 27)}
    assert set(STUDIES) == expected
    if SEED_CLAIMS.is_file():  # beside the repository where it is checked out with it
        ids = set(re.findall(r"^\| ([PC]\d+) \|", SEED_CLAIMS.read_text(), re.M))
        assert ids == expected


def test_only_names_studies_in_table_order() -> None:
    assert parse_only("c21, P5,C1") == ["P5", "C1", "C21"]
    assert parse_only(None)[0] == "P1" and parse_only(None)[-1] == "C26"
    with pytest.raises(KvbenchError, match="C99"):
        parse_only("C1,C99")


def test_bad_only_exits_2_before_any_work(capsys, tmp_path) -> None:
    code, out = run_main(capsys, "claims", "--quick", "--only", "X1", "-o", str(tmp_path))
    assert code == 2 and "unknown ids X1" in out
    assert not (tmp_path / "seed-claims.md").exists()


def test_verdict_rules_pick_the_first_condition_that_holds() -> None:
    assert pick([(False, "reproduced"), (True, "partly")], "refuted") == "partly"
    assert pick([(False, "reproduced")], "refuted") == "refuted"
    with pytest.raises(ValueError, match="unknown verdict"):
        Row("C0", "c", "i", "m", "true", "r")  # type: ignore[arg-type]


@pytest.mark.slow
def test_quick_subset_end_to_end(capsys, tmp_path) -> None:
    """C1 (capacity + a sim run), C21 (real CPU compute across block sizes), C20 and C23
    (computed): every row has figures, a verdict and the commands."""
    code, out = run_main(capsys, "claims", "--quick", "--only", "C1,C20,C21,C23",
                         "-o", str(tmp_path))
    assert code == 0, out
    data = json.loads((tmp_path / "seed-claims.json").read_text())
    rows = {r["id"]: r for r in data["rows"]}
    assert list(rows) == ["C1", "C20", "C21", "C23"]
    assert all(r["verdict"] in VERDICTS and r["commands"] and r["rule"] for r in rows.values())
    assert rows["C1"]["data"]["paged"] == 58  # Llama-2-7B on one A100-80GB, 2048 tokens
    assert rows["C20"]["data"]["224"] == 197
    # Paged at every block size gives the contiguous engine's tokens: RoPE positions are
    # the sequence's own, whatever page holds them.
    assert rows["C21"]["verdict"] == "refuted"
    assert all(v == max(rows["C21"]["data"]["identical"].values())
               for v in rows["C21"]["data"]["identical"].values())
    assert rows["C23"]["verdict"] == "misdescribed"
    table = (tmp_path / "seed-claims.md").read_text()
    assert table.count('\n| <a id="c') == 4 and "kvbench claims --only C21" in table
    assert (tmp_path / "runs" / "c21-paged-bs1" / "paged.json").is_file()
