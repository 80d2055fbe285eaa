"""Published comparison tables: Markdown, CSV and a self-contained HTML page.

Records may come from many run folders, CI shards and machines. Per suite, engines stand
side by side; an engine seen on several machines or devices gets one column each. Every
table carries what is needed to quote it: workload and digest, model, device and clock,
machine and versions, kvbench version and commit, and the exact commands. PNG plots found
in a suite's record folders are embedded under its table in the HTML page.

Records carry the hostname, the full command line and the absolute paths of traces and
weights. Unless ``include_host`` is set, published text leaves the hostname out and cuts
absolute paths to their last name (:func:`kvbench.results.paths.redact_paths`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import InputFileError, KvbenchError
from kvbench.report.baselines import machine_slug
from kvbench.report.compare import mad_spread
from kvbench.report.findings import FINDINGS_TITLE, run_findings
from kvbench.report.labels import engine_labels
from kvbench.report.outputs import check_output_dir, check_output_file, write_outputs
from kvbench.report.plots import RUN_PLOTS, figure_caption, plot_metric_bars
from kvbench.report.tables import machine_load_text, table_cell, table_rows
from kvbench.results.metric_table import METRIC_BY_NAME, MetricSpec, closest, report_metrics
from kvbench.results.paths import redact_paths
from kvbench.results.recordset import FoundRecord
from kvbench.results.repeats import REPEATS_KEY, metric_values, repeat_count
from kvbench.results.schema import NOISY, RunRecord

MARKDOWN_FILE, CSV_FILE, HTML_FILE = "tables.md", "tables.csv", "index.html"
CSV_COLUMNS = [
    "suite", "column", "engine", "machine", "device", "clock", "workload", "workload_digest",
    "kvbench_version", "git_commit", "metric", "value", "repeats", "spread", "unit",
]
# Engine kinds in column order (paged first); other kinds follow, each in run order.
_KIND_ORDER = ("paged", "contiguous", "vllm")


@dataclass(frozen=True, slots=True)
class Privacy:
    """What published text may show: with ``include_host``, the hostname and paths as
    recorded; else neither."""

    include_host: bool
    hostnames: frozenset[str]

    @classmethod
    def of(cls, found: Sequence[FoundRecord], include_host: bool = False) -> Privacy:
        names = {str(f.record.machine.get("hostname") or "") for f in found}
        return cls(include_host, frozenset(n for n in names if n))

    def __call__(self, text: str) -> str:
        return text if self.include_host else redact_paths(text, self.hostnames)


def _column_order(f: FoundRecord) -> tuple[int, str, str]:
    kind = f.record.engine_config.get("kind")
    rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    return rank, f.record.created_utc, f.record.engine


def by_suite(found: Sequence[FoundRecord]) -> dict[str, list[FoundRecord]]:
    """Records by suite; a suite run on several workloads or models (flags overriding its
    own) gets a section per workload and model, named ``suite: workload, model``."""
    groups: dict[str, list[FoundRecord]] = defaultdict(list)
    for f in sorted(found, key=_column_order):
        groups[f.record.suite].append(f)
    out: dict[str, list[FoundRecord]] = {}
    for suite, members in sorted(groups.items()):
        kinds = {(f.record.workload.digest, f.record.model.get("name")) for f in members}
        if len(kinds) == 1:
            out[suite] = members
            continue
        for f in members:
            r = f.record
            out.setdefault(f"{suite}: {r.workload.name}, {r.model.get('name')}", []).append(f)
    return out


def column_labels(found: Sequence[FoundRecord]) -> list[str]:
    """The records' labels (:func:`kvbench.report.labels.engine_labels`), their run
    folders among the facts that tell them apart."""
    return engine_labels([f.record for f in found], [f.path.parent for f in found])


def labelled(found: Sequence[FoundRecord]) -> list[RunRecord]:
    """The records with their column labels as engine names, so that sentences about them
    never name two columns alike."""
    return [f.record.model_copy(update={"engine": label})
            for f, label in zip(found, column_labels(found), strict=True)]


def _versions(r: RunRecord) -> str:
    versions = r.machine.get("versions") or {}
    return ", ".join(f"{k} {v}" for k, v in versions.items() if v)


def _machine(r: RunRecord, include_host: bool) -> str:
    m = r.machine
    text = f"{m.get('cpu')} x{m.get('cpu_count')}"
    if m.get("gpu"):
        g = m["gpu"]
        text += f", {g.get('count', 1)}x {g.get('name')} (CUDA {g.get('cuda')})"
    if include_host and m.get("hostname"):
        text = f"{m['hostname']}: {text}"
    return text


Fact = tuple[str, list[tuple[str | None, str]]]


def context_lines(found: Sequence[FoundRecord], public: Privacy) -> list[Fact]:
    """(name, [(column label, value)]) facts: one value without a label where a suite's
    columns share it, else one per column."""
    labels = column_labels(found)
    records = [f.record for f in found]

    def fact(name: str, values: list[str]) -> Fact:
        values = [public(v) for v in values]
        if len(set(values)) == 1:
            return name, [(None, values[0])]
        return name, [(public(lab), v) for lab, v in zip(labels, values, strict=True)]

    return [
        fact("workload", [f"{r.workload.name} ({r.workload.num_requests} requests, "
                          f"{r.workload.prompt_tokens} prompt / {r.workload.output_tokens} output "
                          f"tokens, source {r.workload.source})" for r in records]),
        fact("workload digest", [r.workload.digest for r in records]),
        fact("model", [f"{r.model.get('name')} ({r.model.get('dtype')})" for r in records]),
        fact("device and clock", [f"{r.device}, {r.clock} clock" for r in records]),
        fact("machine", [_machine(r, public.include_host) for r in records]),
        fact("versions", [f"python {r.machine.get('python')}, {_versions(r)}" for r in records]),
        fact("kvbench", [f"{r.kvbench_version} ({r.git_commit or 'no git'})" for r in records]),
        fact("date", [r.created_utc[:10] for r in records]),
        fact("machine load", [machine_load_text(r) for r in records]),
        fact("repeats", [str(repeat_count(r)) for r in records]),
        fact("command", [r.command for r in records]),
    ]


def table_metrics(names: Sequence[str] | None) -> list[MetricSpec] | None:
    """The metrics ``names`` (table rows, in order), each checked; None: the run tables'."""
    if names is None:
        return None
    unknown = [n for n in names if n not in METRIC_BY_NAME]
    if unknown:
        hints = [f"{n} (did you mean {c}?)" if (c := closest(n, METRIC_BY_NAME)) else n
                 for n in unknown]
        raise KvbenchError(f"unknown metrics: {', '.join(hints)}; see the metric table in "
                           "kvbench.results.metric_table")
    return [METRIC_BY_NAME[n] for n in names]


def suite_rows(found: Sequence[FoundRecord],
               metrics: Sequence[MetricSpec] | None = None) -> list[list[str]]:
    records = [f.record for f in found]
    if metrics is None:
        return table_rows(records)
    return [["status", *[r.status for r in records]]] + [
        [m.label, *[table_cell(m, r) for r in records]] for m in metrics
    ]


def markdown_tables(groups: dict[str, list[FoundRecord]], public: Privacy,
                    metrics: Sequence[MetricSpec] | None = None, notes: str = "") -> str:
    lines = ["# kvbench results", ""]
    for suite, found in groups.items():
        labels = [public(lab) for lab in column_labels(found)]
        lines += [f"## {public(suite)}", ""]
        for name, values in context_lines(found, public):
            if len(values) == 1:
                lines.append(f"- {name}: {_md_code(name, values[0][1])}")
            else:
                lines += [f"- {name}:", *(f"  - {lab}: {_md_code(name, v)}" for lab, v in values)]
        lines += [f"- **warning:** {public(w)}" for w in _warnings(found)]
        lines += ["", "| metric | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        lines += ["| " + " | ".join(row) + " |" for row in suite_rows(found, metrics)]
        if any(repeat_count(f.record) > 1 for f in found):
            lines += ["", "Values are medians over the repeats; measured ones with their "
                      "min-max range."]
        findings = run_findings(labelled(found))
        if findings:
            lines += ["", f"### {FINDINGS_TITLE}", "", *(f"- {public(f)}" for f in findings)]
        lines.append("")
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def _warnings(found: Sequence[FoundRecord]) -> list[str]:
    """The warnings the records keep (``noisy-machine``, ...), each once, by column."""
    labels = column_labels(found)
    return list(dict.fromkeys(f"{lab}: {w}" for f, lab in zip(found, labels, strict=True)
                              for w in f.record.warnings))


def noisy_records(found: Sequence[FoundRecord]) -> list[str]:
    """The record files measured on a noisy machine (their ``noisy-machine`` warning)."""
    return [str(f.path) for f in found
            if any(w.startswith(NOISY) for w in f.record.warnings)]


def _md_code(name: str, text: str) -> str:
    return f"`{text}`" if name in ("command", "workload digest") else text


def csv_table(groups: dict[str, list[FoundRecord]], public: Privacy) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for suite, found in groups.items():
        for label, f in zip(column_labels(found), found, strict=True):
            r = f.record
            for metric in r.summary:
                if metric == REPEATS_KEY:
                    continue
                values = metric_values(r, metric)
                if values is None:
                    continue
                spec = METRIC_BY_NAME.get(metric)
                writer.writerow([
                    public(suite), public(label), public(r.engine), machine_slug(r.machine),
                    r.device, r.clock, public(r.workload.name), r.workload.digest,
                    r.kvbench_version, r.git_commit or "", metric, repr(r.summary[metric]),
                    len(values), f"{mad_spread(values):.6g}", spec.unit if spec else "",
                ])
    return out.getvalue()


def find_plots(found: Sequence[FoundRecord]) -> list[Path]:
    """PNG files in (and below) the folders the records came from: per folder, a run's
    figures in the order runs write them (memory and fragmentation first), then others."""
    order = {name: i for i, (name, _) in enumerate(RUN_PLOTS)}
    seen: dict[Path, Path] = {}
    for f in found:
        pngs = sorted(f.path.parent.rglob("*.png"),
                      key=lambda p: (p.parent, order.get(p.name, len(order)), p.name))
        for png in pngs:
            seen.setdefault(png.resolve(), png)
    return list(seen.values())


_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:80rem}
table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;padding:.3rem .6rem}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th{background:#f3f3f3}div.wide{overflow-x:auto}
dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.2rem 1rem}
dt{font-weight:600}dd{margin:0;overflow-wrap:anywhere}
code{background:#f6f6f6;padding:0 .2rem}figure{margin:1rem 0}img{max-width:100%}
ul.findings{max-width:60rem;line-height:1.45}ul.findings li{margin:.3rem 0}
p.warning{background:#fff4d6;border-left:4px solid #d49b00;padding:.4rem .8rem;max-width:60rem}
"""


def _png_data(png: Path) -> str:
    try:
        return base64.b64encode(png.read_bytes()).decode("ascii")
    except OSError as exc:
        raise InputFileError(png, f"cannot read figure: {exc.strerror or exc}") from None


def html_page(groups: dict[str, list[FoundRecord]], public: Privacy,
              title: str = "kvbench results", metrics: Sequence[MetricSpec] | None = None,
              notes: str = "") -> str:
    def e(text: str) -> str:
        return html.escape(public(text))

    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             f"<title>{e(title)}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>"]
    for suite, found in groups.items():
        labels = column_labels(found)
        parts.append(f"<h2>{e(suite)}</h2><dl>")
        for name, values in context_lines(found, public):
            shown = [(f"{html.escape(lab)}: " if lab else "")
                     + (f"<code>{e(v)}</code>" if name == "command" else e(v))
                     for lab, v in values]
            parts.append(f"<dt>{e(name)}</dt><dd>{'<br>'.join(shown)}</dd>")
        parts.append("</dl>")
        parts += [f"<p class='warning'><b>warning:</b> {e(w)}</p>" for w in _warnings(found)]
        # What the numbers mean first: the table below backs each sentence.
        findings = run_findings(labelled(found))
        if findings:
            parts.append(f"<h3>{FINDINGS_TITLE}</h3><ul class='findings'>")
            parts += [f"<li>{e(f)}</li>" for f in findings]
            parts.append("</ul>")
        # Numbers never wrap; a table wider than the window scrolls instead.
        parts.append("<div class='wide'><table><tr><th>metric</th>")
        parts += [f"<th>{e(lab)}</th>" for lab in labels]
        parts.append("</tr>")
        for row in suite_rows(found, metrics):
            parts.append(f"<tr><td>{e(row[0])}</td>"
                         + "".join(f"<td class='num'>{e(c)}</td>" for c in row[1:]) + "</tr>")
        parts.append("</table></div>")
        if any(repeat_count(f.record) > 1 for f in found):
            parts.append("<p>Values are medians over the repeats; measured ones with their "
                         "min-max range.</p>")
        for png in find_plots(found):
            data = _png_data(png)
            parts.append(f"<figure><img alt='{e(png.name)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{e(figure_caption(png.name))} "
                         f"<small>({e(png.parent.name + '/' + png.name)})</small>"
                         "</figcaption></figure>")
    if notes:
        parts += [f"<pre>{e(notes)}</pre>"]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_run_page(found: Sequence[FoundRecord], out_dir: Path) -> Path:
    """``out_dir``'s index.html: the published page of one run's records (in run order), with
    the figures found beside them."""
    page = html_page({found[0].record.suite: list(found)}, Privacy.of(found), title="kvbench run")
    return write_outputs([(out_dir / HTML_FILE, page, "the run's page")])[0]


def publish(
    found: Sequence[FoundRecord], out_dir: Path, *, include_host: bool = False,
    metrics: Sequence[str] | None = None, name: str | None = None, figure: bool = False,
    notes: str = "", allow_noisy: bool = False,
) -> list[Path]:
    """Write the three files (``name``.md/.csv/.html when named), plus with ``figure`` a PNG
    of the tables' metrics; all are rendered before any is written. ``metrics`` picks the
    table rows (default: the run tables'); ``notes`` is Markdown placed under the tables.
    Records measured on a noisy machine are refused unless ``allow_noisy`` (the pages then
    show their warnings)."""
    check_output_dir(out_dir, "output folder")
    noisy = noisy_records(found)
    if noisy and not allow_noisy:
        raise KvbenchError(
            f"{', '.join(noisy[:3])}{' ...' if len(noisy) > 3 else ''}: measured on a noisy "
            "machine (their noisy-machine warning); rerun on a quiet machine, or give "
            "--allow-noisy to publish them with the warning shown")
    rows = table_metrics(metrics)
    groups = by_suite(found)
    public = Privacy.of(found, include_host)
    md, csv_file, html_file = (
        (f"{name}.md", f"{name}.csv", f"{name}.html") if name else
        (MARKDOWN_FILE, CSV_FILE, HTML_FILE)
    )
    png = out_dir / f"{name or 'tables'}.png"
    if figure:
        check_output_file(png, "the figure")
    written = write_outputs([
        (out_dir / md, markdown_tables(groups, public, rows, notes), "the Markdown tables"),
        (out_dir / csv_file, csv_table(groups, public), "the CSV table"),
        (out_dir / html_file, html_page(groups, public, metrics=rows, notes=notes),
         "the HTML page"),
    ])
    if figure:
        sections = [(public(s), [f.record for f in fs], [public(lab) for lab in column_labels(fs)])
                    for s, fs in groups.items()]
        written.append(plot_metric_bars(sections, rows or report_metrics(), png))
    return written
