"""Tables printed to something that is not a terminal (CI logs, pipes) keep every cell whole."""

from __future__ import annotations

import io
from pathlib import Path

from record_factory import make_record, write
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.report.tables import print_table

CELLS = ["contiguous-request-reservation", "paged-with-prefix-caching", "123456789.123 MiB"]


def _table() -> Table:
    table = Table(title="capacity")
    for name in ("policy", "variant", "KV budget after weights and activations"):
        table.add_column(name)
    table.add_row(*CELLS)
    table.add_row(*reversed(CELLS))
    return table


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_prints_cells_whole() -> None:
    out = io.StringIO()
    print_table(Console(file=out, width=60), _table())
    text = out.getvalue()
    assert "…" not in text
    for cell in (*CELLS, "KV budget after weights and activations"):
        assert cell in text
    assert max(map(len, text.splitlines())) > 60


def test_a_terminal_gets_the_table_fitted_to_its_width() -> None:
    out = _Terminal()
    print_table(Console(file=out, width=60, force_terminal=True, color_system=None), _table())
    assert max(map(len, out.getvalue().splitlines())) <= 60


def test_report_in_a_pipe_keeps_long_engine_names(tmp_path: Path) -> None:
    engines = ["contiguous-request", "contiguous-compact", "contiguous-pow2", "paged-leaky",
               "paged-prefix-caching"]
    for engine in engines:
        write(make_record(engine), tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    for name in (*engines, "KV utilization (used/reserved)"):
        assert name in result.output
