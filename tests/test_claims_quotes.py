"""The reports' words behind every policy and claim: present for each study, and each an
exact excerpt of the report it names (runs of whitespace aside)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.tools.claims import STUDIES, quotes

REPORTS = Path(__file__).resolve().parents[2] / "shared" / "field-reports"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_study_has_the_reports_words_and_a_translation() -> None:
    words = quotes()
    assert set(words) == set(STUDIES)
    for ident, q in words.items():
        assert q["zh"] and q["en"] and q["report"], ident
        for k in ("zh2", "zh3"):
            assert bool(q.get(k)) == bool(q.get(k.replace("zh", "en"))), ident


@pytest.mark.skipif(not REPORTS.is_dir(), reason="the field reports are not beside the checkout")
def test_every_quote_is_the_reports_own_text() -> None:
    texts = {p.name: _flat(p.read_text()) for p in REPORTS.glob("*.txt")}
    for ident, q in quotes().items():
        for n, key in enumerate(("zh", "zh2", "zh3"), start=1):
            if q.get(key):
                report = q.get(f"report{n}", q["report"]) if n > 1 else q["report"]
                assert _flat(q[key]) in texts[report], f"{ident}.{key} is not in {report}"
