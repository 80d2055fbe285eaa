"""Helpers shared by test modules."""

from __future__ import annotations

from pathlib import Path

from kvbench.workloads.model import Request, Segment, Workload

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def text_request(
    rid: str, prompt: int, output: int, arrival: float = 0.0, *, key: str | None = None, n: int = 1
) -> Request:
    return Request(rid, arrival, (Segment("text", prompt, key or f"t/{rid}"),), output, n=n)


def make_workload(requests: list[Request], name: str = "test") -> Workload:
    return Workload(name, sorted(requests, key=lambda r: r.arrival_s), seed=0, source="tests")


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """``kvbench ARGS`` through the real entry point (error handling included), in this
    process: its exit status and everything it printed."""
    import sys

    from kvbench.cli.app import main

    argv, sys.argv = sys.argv, ["kvbench", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out + out.err
