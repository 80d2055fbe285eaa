"""Errors that end a command with a clear message instead of a traceback."""


class KvbenchError(Exception):
    """A user-facing error: bad input or an impossible configuration.

    The CLI prints the message (which says what to do) and exits with status 2.
    """


class InputFileError(KvbenchError):
    """A malformed input file; the message names the file and, where known, the line."""

    def __init__(self, path: object, message: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line
