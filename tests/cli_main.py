"""The `kvbench` entry point run in-process as a shell runs it: exit status and output.

CliRunner calls the typer app and so skips ``main``, which turns user-facing errors into
exit status 2; these tests need exactly that path.
"""

from __future__ import annotations

import sys
import traceback

import pytest

from kvbench.cli.app import main


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Exit status and stdout + stderr of ``kvbench ARGS``; an exception that escapes
    ``main`` is printed as the interpreter would, so a test can look for its traceback."""
    saved = sys.argv
    sys.argv = ["kvbench", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``kvbench(*args) -> (exit status, output)`` for a test's fixture; output is not
    wrapped, so messages with long paths read whole."""
    monkeypatch.setenv("COLUMNS", "1000")
    return lambda *args: run_main(capsys, *map(str, args))
