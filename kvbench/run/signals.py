"""SIGTERM (what CI cancellation sends) handled like Ctrl-C: both interrupt the run where it
is, the records of what ran are written, and the exit status says which signal it was."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt, so every
    handler of one handles the other."""


def interrupt_reason(exc: KeyboardInterrupt) -> str:
    if isinstance(exc, Terminated):
        return "interrupted by SIGTERM (e.g. a cancelled CI job)"
    return "interrupted by the user (Ctrl-C)"


@dataclass(slots=True)
class Interrupts:
    """What :func:`sigterm_interrupts` saw: whether SIGTERM arrived."""

    terminated: bool = False

    @property
    def exit_status(self) -> int:
        return EXIT_SIGTERM if self.terminated else EXIT_SIGINT


@contextmanager
def sigterm_interrupts() -> Iterator[Interrupts]:
    """Within the block, SIGTERM raises :class:`Terminated` (main thread only)."""
    state = Interrupts()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        state.terminated = True
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield state
        return
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)
