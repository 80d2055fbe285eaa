"""Nox sessions: tests, lint, demo (and the vLLM baseline in its own environment)."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
CPU_EXTRAS = ".[cpu,test]"


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (CUDA tests skip without a GPU; vLLM tests live in `vllm`)."""
    session.install("-e", CPU_EXTRAS)
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on its embedded default: real compute on the CPU, paged vs contiguous."""
    session.install("-e", ".[cpu]")
    session.run("kvbench", "run", *session.posargs)
