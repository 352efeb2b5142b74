"""Progress on stderr for the long commands (demo, bench)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any


class Progress:
    """Progress on stderr: a rich bar when stderr is a terminal (and `enabled`), plain
    lines otherwise, so a run in a pipe, a log file or CI still shows it is alive.

    A line is written when the phase (the text before the first `:`) changes, or every
    `every` seconds; each starts with `[tierkv COMMAND   12.3s]`."""

    def __init__(
        self,
        enabled: bool,
        total: int | None,
        description: str,
        *,
        command: str = "",
        every: float = 5.0,
        stream: Any = None,
    ) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._stream = stream if stream is not None else sys.stderr
        self._lines = not self._stream.isatty()
        self._command = command
        self._every = every
        self._started = time.monotonic()
        self._last_line = -float("inf")
        self._last_phase: str | None = None
        self._done = 0
        self._total = total
        if self._lines:
            self._line(description, force=True)
            return
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        self._bar = Progress(*columns, console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, description: str, advance: int = 0) -> None:
        self._done += advance
        if self._lines:
            self._line(description)
        elif self._bar is not None:
            self._bar.update(self._task, description=description, advance=advance)

    def _line(self, description: str, *, force: bool = False) -> None:
        now = time.monotonic()
        phase = description.split(":", 1)[0]
        if not force and phase == self._last_phase and now - self._last_line < self._every:
            return
        self._last_phase, self._last_line = phase, now
        count = f" ({self._done}/{self._total})" if self._total else ""
        with contextlib.suppress(OSError, ValueError):
            print(
                f"[tierkv {self._command} {now - self._started:6.1f}s] {description}{count}",
                file=self._stream,
                flush=True,
            )
