"""SIGTERM (what CI cancellation sends) handled like Ctrl-C: both interrupt the run where it
is, the records of what ran are written, and the exit status says which signal it was.

Where an interrupt may land matters: one that came while an engine was set up or its record
written would lose records. :func:`deferred_interrupts` holds both signals back, except
inside :func:`allow_interrupts` blocks (an engine starting, its run loop), whose callers turn
the interrupt into an interrupted record; one held back is raised at the next such block or
when the caller asks (:meth:`Held.deliver`)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class Held:
    """What :func:`deferred_interrupts` holds: the first signal that came outside an
    :func:`allow_interrupts` block (``signum``), and the handlers that raise each signal."""

    signum: int | None = None
    handlers: dict[int, Callable[[int, FrameType | None], object]] = field(default_factory=dict)
    depth: int = 0  # allow_interrupts blocks entered

    @property
    def reason(self) -> str:
        return interrupt_reason(Terminated() if self.signum == signal.SIGTERM
                                else KeyboardInterrupt())

    def deliver(self) -> None:
        """Raise the interrupt held back, if one came, as its own handler would."""
        if self.signum is not None:
            signum, self.signum = self.signum, None
            self.handlers[signum](signum, None)


_held: Held | None = None


@contextmanager
def deferred_interrupts() -> Iterator[Held]:
    """Within the block, Ctrl-C and SIGTERM wait (the first is kept) except inside
    :func:`allow_interrupts` blocks. Only signals whose handler raises are held (an ignored
    SIGINT stays ignored, a default SIGTERM still ends the process); nothing is held outside
    the main thread. A block inside another shares the outer's."""
    global _held
    if _held is not None:
        yield _held
        return
    held = Held()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if held.depth:
            held.handlers[signum](signum, frame)
        elif held.signum is None:
            held.signum = signum

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):
                signal.signal(signum, on_signal)
                held.handlers[signum] = handler
    except ValueError:  # not the main thread
        yield held
        return
    _held = held
    try:
        yield held
    finally:
        _held = None
        for signum, handler in held.handlers.items():
            signal.signal(signum, handler)


@contextmanager
def allow_interrupts() -> Iterator[None]:
    """Within :func:`deferred_interrupts`, a block where interrupts raise (one held back
    first); elsewhere nothing changes."""
    held = _held
    if held is None:
        yield
        return
    held.depth += 1
    try:
        held.deliver()
        yield
    finally:
        held.depth -= 1
