"""Errors plugins raise to the bridge; each maps to one clear user-facing outcome."""

from __future__ import annotations


class FlagError(Exception):
    """A plugin flag has a bad or impossible value: the CLI exits 2 naming the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


class RequestRejected(Exception):
    """A request is refused before generation starts: becomes an HTTP error with this status.

    Raised before any stream starts, so a client never sees an error frame inside a 200 stream.
    """

    def __init__(self, status_code: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.retry_after = retry_after
