"""Bad input in every workload-side file format ends in an error naming file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.generator import generate
from kvbench.workloads.io import load_workload, load_workload_arg, save_workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.spec import parse_spec
from kvbench.workloads.specfile import load_spec_file
from kvbench.workloads.traces import import_trace

AZURE_HEAD = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = b"2023-11-16 18:15:46.6805900,374,44\n"
MOONCAKE_ROW = b'{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
SHAREGPT = (
    b'[\n {"conversations": [{"from": "human", "value": "hi there"},\n'
    b'                     {"from": "gpt", "value": "hello"}]}\n]\n'
)


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _workload_file(tmp_path: Path) -> tuple[Path, list[str]]:
    p = save_workload(generate_preset("mixed-text", num_requests=4), tmp_path / "w.jsonl")
    return p, p.read_text().splitlines()


def _import(kind: str):
    return lambda p: import_trace(kind, p)


READERS = {
    "azure": ("a.csv", AZURE_HEAD + AZURE_ROW, _import("azure")),
    "mooncake": ("m.jsonl", MOONCAKE_ROW, _import("mooncake")),
    "sharegpt": ("s.json", SHAREGPT, _import("sharegpt")),
}


def _expect(read, path: Path, message: str, line: int | None) -> InputFileError:
    with pytest.raises(InputFileError, match=message) as e:
        read(path)
    assert e.value.line == line
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    assert str(e.value).startswith(prefix), str(e.value)
    return e.value


# --- encodings, binary files and folders, in every format -------------------------------


@pytest.mark.parametrize("kind", [*READERS, "workload"])
def test_byte_order_mark_loads(tmp_path: Path, kind: str) -> None:
    if kind == "workload":
        p, _ = _workload_file(tmp_path)
        plain = load_workload(p)
        p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
        assert load_workload(p).digest == plain.digest
        return
    name, data, read = READERS[kind]
    plain = read(_write(tmp_path, name, data))
    assert read(_write(tmp_path, "bom-" + name, b"\xef\xbb\xbf" + data)).digest == plain.digest


@pytest.mark.parametrize("kind", [*READERS, "workload"])
def test_non_utf8_byte_names_its_line(tmp_path: Path, kind: str) -> None:
    if kind == "workload":
        p, lines = _workload_file(tmp_path)
        lines[2] = lines[2].replace("text", "t\xe9xt")
        p.write_bytes("\n".join(lines).encode("latin-1"))
        _expect(load_workload, p, r"not UTF-8 text \(byte 0xe9 at offset", 3)
        return
    name, data, read = READERS[kind]
    bad = data.replace(b"44", b"4\xff") if kind == "azure" else data.replace(b"h", b"\xe9h", 1)
    line = bad.count(b"\n", 0, bad.index(b"\xe9" if kind != "azure" else b"\xff")) + 1
    _expect(read, _write(tmp_path, name, bad), "not UTF-8 text .*saved as UTF-8", line)


@pytest.mark.parametrize("kind", [*READERS, "workload"])
def test_binary_and_compressed_files(tmp_path: Path, kind: str) -> None:
    read = load_workload if kind == "workload" else READERS[kind][2]
    text = _workload_file(tmp_path)[0].read_bytes() if kind == "workload" else READERS[kind][1]
    _expect(read, _write(tmp_path, "x.gz", gzip.compress(text)), r"gunzip -k FILE", None)
    _expect(read, _write(tmp_path, "x.zip", b"PK\x03\x04" + text), "zip archive", None)
    _expect(read, _write(tmp_path, "x.u16", text.decode().encode("utf-16")), "UTF-16", None)
    nul = text[:10] + b"\x00" + text[10:]
    line = text.count(b"\n", 0, 10) + 1
    _expect(read, _write(tmp_path, "x.bin", nul), "NUL byte: a binary file", line)


@pytest.mark.parametrize("kind", [*READERS, "workload"])
def test_a_folder_is_not_a_file(tmp_path: Path, kind: str) -> None:
    read = load_workload if kind == "workload" else READERS[kind][2]
    folder = tmp_path / ("traces.jsonl" if kind == "workload" else "traces")
    folder.mkdir()
    _expect(read, folder, "is a folder, not a .*file; pass the file itself", None)
    _expect(read, tmp_path / "absent", "no such file", None)


def test_workload_argument_folder(tmp_path: Path) -> None:
    _expect(lambda p: load_workload_arg(str(p)), tmp_path, "is a folder", None)
    _expect(lambda p: load_workload_arg(f"azure:{p}"), tmp_path, "is a folder", None)


# --- Azure timestamps ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stamp", "message"),
    [
        ("2023-13-16 18:15:47", r"TIMESTAMP '2023-13-16 18:15:47' is not a real date \(month"),
        ("2023-02-30 18:15:47", "is not a real date"),
        ("2023-11-16 25:15:47", "is not a real time of day"),
        ("2023-11-16 18:61:47", "is not a real time of day"),
        ("16/11/2023 18:15:47", "is not like '2023-11-16 18:15:46.6805900'"),
    ],
)
def test_azure_timestamp_that_does_not_parse(tmp_path: Path, stamp: str, message: str) -> None:
    p = _write(tmp_path, "a.csv", AZURE_HEAD + AZURE_ROW + f"{stamp},5,1\n".encode())
    _expect(_import("azure"), p, message, 3)


def test_azure_timestamp_forms_and_utc_offsets(tmp_path: Path) -> None:
    p = _write(tmp_path, "a.csv", AZURE_HEAD + (
        b"2024-10-15T12:00:00.269Z,1,1\n"
        b"2024-10-15 12:00:01.5+00:00,1,1\n"
        b"2024-10-15 14:00:02-02:00,1,1\n"  # 16:00:02 UTC
        b"2024-10-15 12:00:03.000000001+0100,1,1\n"  # 11:00:03 UTC: the earliest
    ))
    arrivals = [r.arrival_s for r in import_trace("azure", p).requests]
    assert arrivals == pytest.approx(
        [0.0, 3597.268999999, 3598.499999999, 17_998.999999999], abs=1e-9
    )


def test_one_row_from_1900_is_named(tmp_path: Path) -> None:
    rows = AZURE_ROW * 3 + b"1900-01-01 00:00:00,5,1\n" + AZURE_ROW
    err = _expect(_import("azure"), _write(tmp_path, "a.csv", AZURE_HEAD + rows),
                  r"time 1900-01-01 00:00:00 lies 123\.9 years before the trace's median row; "
                  r"a trace may span at most 366 days", 5)
    assert "fix or delete this row" in str(err)
    late = AZURE_ROW * 3 + b"2100-01-01 00:00:00,5,1\n"
    _expect(_import("azure"), _write(tmp_path, "b.csv", AZURE_HEAD + late),
            r"lies 76\.1 years after", 5)


def test_a_year_of_trace_is_accepted(tmp_path: Path) -> None:
    rows = AZURE_ROW + b"2024-11-15 18:15:46.6805900,5,1\n"  # 365 days later
    w = import_trace("azure", _write(tmp_path, "a.csv", AZURE_HEAD + rows))
    assert w.requests[-1].arrival_s == 365 * 86_400


def test_azure_schema_mismatch_shows_the_header(tmp_path: Path) -> None:
    p = _write(tmp_path, "a.csv", b"Timestamp,ContextTokens,GeneratedTokens\n" + AZURE_ROW)
    _expect(_import("azure"), p, "missing column.s. TIMESTAMP; expected the header "
            "TIMESTAMP,ContextTokens,GeneratedTokens but found "
            "Timestamp,ContextTokens,GeneratedTokens", 1)


# --- absurd values -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "data", "line", "message"),
    [
        ("azure", AZURE_HEAD + AZURE_ROW + b"2023-11-16 18:15:47,2147483000,1000\n", 3,
         r"prompt \(2,147,483,000\) plus output \(1,000\) tokens exceed 2,147,483,647"),
        ("azure", AZURE_HEAD + AZURE_ROW + b"2023-11-16 18:15:47,5,1000000000000\n", 3,
         "output .1,000,000,000,000. tokens exceed"),
        ("mooncake", MOONCAKE_ROW + MOONCAKE_ROW.replace(b"600", b"1000000000000"), 2,
         "plus output .4. tokens exceed"),
        ("mooncake", MOONCAKE_ROW + MOONCAKE_ROW.replace(b'"timestamp": 0', b'"timestamp": 1e300'),
         2, r"time 1e\+300 ms lies .* years after"),
        ("mooncake", MOONCAKE_ROW.replace(b'"timestamp": 0', b'"timestamp": Infinity'), 1,
         "timestamp must be a finite number"),
        ("mooncake", MOONCAKE_ROW.replace(b'"timestamp": 0', b'"timestamp": NaN'), 1,
         "timestamp must be ms >= 0"),
    ],
)
def test_absurd_trace_rows(tmp_path: Path, kind: str, data: bytes, line: int,
                           message: str) -> None:
    name = READERS[kind][0]
    _expect(_import(kind), _write(tmp_path, name, data), message, line)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arrival_s": 1e300}, r"arrival_s 1e\+300 is not within 0 to 31622400 s \(366 days\)"),
        ({"arrival_s": float("inf")}, "arrival_s inf is not within"),
        ({"arrival_s": float("nan")}, "arrival_s nan is not within"),
        ({"output_tokens": 10**12},
         "output_tokens: Input should be less than or equal to 2147483647"),
        ({"output_tokens": 2**31 - 2},
         r"prompt \(\d+\) plus output \(2,147,483,646\) tokens exceed"),
        ({"n": 100_000}, "n: Input should be less than or equal to 1024"),
        ({"segments": [{"kind": "text", "tokens": 2**31, "key": "k"}]},
         "tokens: Input should be less than or equal to 2147483647"),
    ],
)
def test_absurd_workload_rows(tmp_path: Path, change: dict, message: str) -> None:
    p, lines = _workload_file(tmp_path)
    row = {**json.loads(lines[-1]), **change}
    lines[-1] = json.dumps(row)  # json writes NaN and Infinity, as Python reads them
    p.write_text("\n".join(lines) + "\n")
    _expect(load_workload, p, f"bad request: .*{message}", len(lines))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": 100_000}, r"classes\[0\]\.n: Input should be less than or equal to 1024"),
        ({"output": {"kind": "fixed", "value": 10**12}},
         r"classes\[0\]\.output\.value: Input should be less than or equal to 2147483647"),
        ({"prompt": {"kind": "lognormal", "median": 100, "sigma": 1, "max": 2**40}},
         r"classes\[0\]\.prompt\.max: Input should be less than or equal to 2147483647"),
        ({"session": {"turns": {"kind": "fixed", "value": 2}, "think_time_s": 1e12}},
         r"classes\[0\]\.session\.think_time_s: Input should be less than or equal to"),
    ],
)
def test_absurd_spec_values_name_the_key(change: dict, message: str) -> None:
    cls = {"name": "c", "prompt": {"kind": "fixed", "value": 8},
           "output": {"kind": "fixed", "value": 8}, **change}
    with pytest.raises(KvbenchError, match=f"^spec.toml: invalid workload spec: {message}"):
        parse_spec({"classes": [cls]}, "spec.toml")


def _spec(**cls: object) -> dict:
    return {"classes": [{"name": "c", "prompt": {"kind": "fixed", "value": 8},
                         "output": {"kind": "fixed", "value": 8}, **cls}]}


def test_generated_requests_within_limits() -> None:
    huge = parse_spec(_spec(prompt={"kind": "fixed", "value": 2**31 - 5}), "s")
    with pytest.raises(KvbenchError, match=r"^big: class 'c' makes a request whose prompt "
                       r"\(2,147,483,643\) plus output \(8\) tokens exceed"):
        generate(huge, 3, name="big")
    # Sessions grow: the fourth turn of 700M-token turns passes the limit.
    turns = parse_spec(_spec(
        prompt={"kind": "fixed", "value": 350_000_000},
        output={"kind": "fixed", "value": 350_000_000},
        session={"turns": {"kind": "fixed", "value": 5}, "think_time_s": 1.0},
    ), "s")
    with pytest.raises(KvbenchError, match=r"prompt \(2,450,000,000\) plus output"):
        generate(turns, 5, name="turns")
    slow = parse_spec({**_spec(), "arrival": {"kind": "constant", "rate": 1e-6}}, "s")
    with pytest.raises(KvbenchError, match=r"^slow: arrivals reach 99,000,000 s, past the 366 "
                       "days a workload may span; raise the arrival rate"):
        generate(slow, 100, name="slow")
    generate(slow, 30, name="slow")  # 29,000,000 s: within a year


def test_trace_arrivals_spanning_years() -> None:
    with pytest.raises(KvbenchError, match=r"arrival\.timestamps_s: timestamps span 1e\+300 s"):
        parse_spec({**_spec(), "arrival": {"kind": "trace", "timestamps_s": [0, 1e300]}}, "s")


# --- spec files -----------------------------------------------------------------------------


def test_spec_file_errors(tmp_path: Path) -> None:
    toml = _write(tmp_path, "spec.toml", b'num_requests = 5\n[[classes]]\nname = = "x"\n')
    _expect(load_spec_file, toml, "not valid TOML: Invalid value", 3)
    js = _write(tmp_path, "spec.json", b'{\n  "classes": [\n    {"name": }\n  ]\n}\n')
    _expect(load_spec_file, js, "not valid JSON: Expecting value", 3)
    _expect(load_spec_file, _write(tmp_path, "spec.yaml", b"classes: []\n"),
            "must end in .toml or .json", None)
    with pytest.raises(KvbenchError, match=r"list\.json: a workload spec must be a table with "
                       r"'classes' \(got list\)"):
        load_spec_file(_write(tmp_path, "list.json", b"[1]"))
    bad = _write(tmp_path, "bad.toml", b'[[classes]]\nname = "a"\n'
                 b'prompt = { kind = "lognormal", median = 0, sigma = 1 }\n'
                 b'output = { kind = "uniform", low = 9, high = 2 }\n')
    with pytest.raises(KvbenchError, match=(
        rf"^{bad}: invalid workload spec: classes\[0\]\.prompt\.median: Input should be "
        r"greater than 0; classes\[0\]\.output: high \(2\) must be >= low \(9\)$"
    )):
        load_spec_file(bad)
