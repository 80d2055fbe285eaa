"""The published tables under results/tables/: each says how it was measured, and none
contradicts the claims table on a verdict or on a figure both state (one source of truth:
seed-claims.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvbench.results.provenance import LINE
from kvbench.tools.claims.core import VERDICTS

TABLES = Path(__file__).resolve().parents[1] / "results" / "tables"
MARKDOWN = sorted(TABLES.rglob("*.md"))
# A verdict or a figure stated outside the claims table: a link to its row, e.g.
# [P9: not measurable here](seed-claims.md#p9) or [C15: 30.42 GB](seed-claims.md#c15).
ROW_LINK = re.compile(r"\[(?P<id>[PC]\d+): (?P<text>[^\]]+)\]\(seed-claims\.md#[pc]\d+\)")
# Every verdict word but "partly", which prose uses in its plain sense.
VERDICT_WORDS = re.compile(r"\b(" + "|".join(v for v in VERDICTS if v != "partly") + r")\b",
                           re.I)


def _record_page(text: str) -> bool:
    """A page written from run records (`kvbench run`'s summary, `kvbench publish`): its
    commit, date, machine and load per engine come from the records."""
    return (text.startswith(("# kvbench run:", "# kvbench results"))
            and re.search(r"\b[0-9a-f]{40}\b", text) is not None
            and "date: " in text and "machine: " in text
            and ("1-min load" in text or "virtual clock" in text or "clock virtual" in text))


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(TABLES)))
def test_every_table_says_how_it_was_measured(path: Path) -> None:
    text = path.read_text()
    stamped = any(LINE.match(line) for line in text.splitlines())
    assert stamped or _record_page(text), (
        f"{path.name} states no commit, date, machine and load: stamp it with "
        "kvbench.results.provenance (see its docstring)")


def test_no_table_contradicts_the_claims_table() -> None:
    rows = {r["id"]: r for r in json.loads((TABLES / "seed-claims.json").read_text())["rows"]}
    assert set(VERDICTS) >= {r["verdict"] for r in rows.values()}
    for path in MARKDOWN:
        if path.name == "seed-claims.md":
            continue
        text = path.read_text()
        for m in ROW_LINK.finditer(text):
            row = rows[m["id"]]
            if m["text"] in VERDICTS:
                assert m["text"] == row["verdict"], (
                    f"{path.name} says {m['id']} is {m['text']}; seed-claims.md says "
                    f"{row['verdict']}")
            else:  # a figure: the claims table states the same
                assert m["text"] in row["measured"], (
                    f"{path.name} quotes {m['id']} as {m['text']!r}, which seed-claims.md's "
                    f"row does not state: {row['measured']}")
        loose = VERDICT_WORDS.findall(ROW_LINK.sub("", text))
        assert not loose, (f"{path.name} states verdicts ({', '.join(sorted(set(loose)))}) "
                           "outside links to seed-claims.md rows: link the row instead")
