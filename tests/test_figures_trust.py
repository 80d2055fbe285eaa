"""Figures a reader can trust: one colour per engine everywhere, captions that say what a
figure shows, dense series drawn as a readable band, run tables without empty rows."""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from matplotlib.collections import PolyCollection
from record_factory import changed, make_record, write

from kvbench.report.plots import (
    FIGURE_CAPTIONS,
    RUN_PLOTS,
    _dense_line,
    _figure,
    engine_color,
    engine_styles,
    figure_caption,
    write_plots,
)
from kvbench.report.publish import write_run_page
from kvbench.report.tables import table_rows
from kvbench.results.recordset import FoundRecord


def test_an_engine_has_one_colour_in_every_record_set() -> None:
    first = dict(zip(["paged", "contiguous", "my-policy"],
                     engine_styles(["paged", "contiguous", "my-policy"]), strict=True))
    second = dict(zip(["vllm", "my-policy", "paged"],
                      engine_styles(["vllm", "my-policy", "paged"]), strict=True))
    assert first["paged"] == second["paged"] and first["my-policy"] == second["my-policy"]
    common = ["paged", "contiguous", "contiguous-request", "vllm", "openai"]
    assert len({engine_color(e) for e in common}) == len(common)


def test_the_same_engine_twice_differs_by_line_style_not_colour() -> None:
    (c1, ls1), (c2, ls2) = engine_styles(["paged", "paged"])
    assert c1 == c2 == engine_color("paged") and ls1 != ls2


def test_a_hashed_colour_is_the_same_in_another_process() -> None:
    code = "from kvbench.report.plots import engine_color; print(engine_color('my-policy'))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == engine_color("my-policy")


def test_every_figure_has_a_caption_and_the_run_page_shows_it(tmp_path: Path) -> None:
    for name, _ in (*RUN_PLOTS, ("soak.png", None), ("sweep.png", None), ("tables.png", None)):
        assert name in FIGURE_CAPTIONS and figure_caption(name) != name
    records = [make_record("paged", clock="wall"), make_record("contiguous", clock="wall")]
    written, errors = write_plots(records, tmp_path)
    assert not errors and written
    found = [FoundRecord(write(r, tmp_path), r) for r in records]
    page = write_run_page(found, tmp_path).read_text()
    for png in written:
        assert f"<figcaption>{html.escape(figure_caption(png.name), quote=True)}" in page


def test_a_series_denser_than_the_pixels_becomes_a_band_with_its_median() -> None:
    fig = _figure(1)
    ax = fig.subplots()
    t = np.linspace(0.0, 100.0, 20_000)
    y = np.sin(t * 7.0)
    _dense_line(ax, t, y, "black", "fragmentation index")
    [band] = [c for c in ax.collections if isinstance(c, PolyCollection)]
    [median] = ax.lines
    assert len(median.get_xdata()) < 2_000
    assert median.get_label() == "fragmentation index (median)"
    assert band.get_label() == "fragmentation index (min-max)"
    assert float(np.max(median.get_ydata())) <= 1.0 and float(np.min(median.get_ydata())) >= -1.0


def test_a_sparse_series_stays_a_plain_line() -> None:
    fig = _figure(1)
    ax = fig.subplots()
    _dense_line(ax, np.arange(100.0), np.arange(100.0), "black", "rss")
    assert not ax.collections and len(ax.lines[0].get_xdata()) == 100


def test_an_all_empty_row_is_dropped_and_a_row_with_any_value_stays() -> None:
    a = changed(make_record("paged"), peak_device_bytes=None, prefix_hit_rate=0.5)
    b = changed(make_record("contiguous"), peak_device_bytes=None, prefix_hit_rate=None)
    rows = {row[0]: row[1:] for row in table_rows([a, b])}
    assert "peak device memory" not in rows
    assert rows["prefix cache hit rate"] == ["50.0%", "-"]
    assert rows["status"] == ["ok", "ok"]
