"""Single keypresses from the terminal, for interactive views (``top`` quits on ``q``).

cbreak mode: keys arrive without Enter and without echo, while Ctrl-C still
sends SIGINT.  When stdin is not a terminal there are no keys (``fd`` None)
and the terminal is never touched; the mode is always restored on exit.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import IO


class Keys:
    """Context manager: ``fd`` to poll (None without a terminal), ``read()`` what was typed."""

    def __init__(self, stream: IO[str] | None = None, *, enabled: bool = True) -> None:
        stream = sys.stdin if stream is None else stream
        try:
            self.fd: int | None = stream.fileno() if enabled and stream.isatty() else None
        except (AttributeError, OSError, ValueError):  # closed or not a real file (pytest's capture)
            self.fd = None
        self._saved: list | None = None

    def __enter__(self) -> "Keys":
        if self.fd is not None:
            import termios
            import tty

            try:
                self._saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd, termios.TCSANOW)
            except termios.error:
                self.fd = None
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._saved is not None and self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def read(self) -> str:
        """What has been typed since the last read ("" at end of input)."""
        if self.fd is None:
            return ""
        return os.read(self.fd, 64).decode("utf-8", "replace")
