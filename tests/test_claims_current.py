"""`kvbench claims --check`: a published table's verdicts and figures against what the code
computes now."""

from __future__ import annotations

import json

from cli_main import run_main

from kvbench.tools.claims.current import differences


def test_differences_name_every_changed_figure() -> None:
    old = {"a": 1.0, "b": [1, 2], "c": {"x": "same"}, "gone": 1}
    new = {"a": 1.0 + 1e-12, "b": [1, 3], "c": {"x": "same"}, "added": 2}
    found = differences(old, new, "data")
    assert "data.b[1]: published 2, now 3" in found
    assert any(d.startswith("data.gone: only in the published") for d in found)
    assert any(d.startswith("data.added: only in the new") for d in found)
    assert not any(d.startswith("data.a:") for d in found)  # float noise is not a change


def test_check_passes_on_a_current_table_and_fails_on_a_changed_one(capsys, tmp_path) -> None:
    code, out = run_main(capsys, "claims", "--quick", "--only", "C20,C23",
                         "-o", str(tmp_path / "pub"))
    assert code == 0, out
    published = tmp_path / "pub" / "seed-claims.json"
    code, out = run_main(capsys, "claims", "--check", str(published), "-o",
                         str(tmp_path / "now"))
    assert code == 0 and "2 published rows still hold: C20, C23" in out, out
    data = json.loads(published.read_text())
    row = next(r for r in data["rows"] if r["id"] == "C20")
    row["verdict"] = "reproduced" if row["verdict"] != "reproduced" else "refuted"
    row["data"]["224"] += 1
    published.write_text(json.dumps(data))
    code, out = run_main(capsys, "claims", "--check", str(published), "-o",
                         str(tmp_path / "again"))
    assert code == 1, out
    assert "C20: verdict: published" in out and "C20: data.224: published" in out
    assert "2 differences" in out


def test_check_refuses_a_file_that_is_not_a_claims_table(capsys, tmp_path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    code, out = run_main(capsys, "claims", "--check", str(bad), "-o", str(tmp_path / "o"))
    assert code == 2 and "not a seed-claims.json" in out
