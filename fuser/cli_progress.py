"""The stage bar of a long `fuse`: one line on stderr naming the stage (load, match, decide,
finish, verify, validate, save) with how far it is.

Drawn only when stderr is a terminal (nothing in pipes, files and CI logs), only once the run
has taken `FUSER_PROGRESS_AFTER_S` seconds (default 1; a quick fuse draws nothing), and never
with `--quiet`. It draws on demand, not from a refresh thread: each stage is drawn when it is
first entered, other updates at most every `REDRAW_S`, so a pass that reports thousands of
times costs a few redraws.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .cli_common import err

REDRAW_S = 0.1
DEFAULT_AFTER_S = 1.0


def delay_s() -> float:
    """Seconds a run must take before the bar appears (FUSER_PROGRESS_AFTER_S, else 1)."""
    try:
        return float(os.environ.get("FUSER_PROGRESS_AFTER_S", DEFAULT_AFTER_S))
    except ValueError:
        return DEFAULT_AFTER_S


class StageBar:
    """A `progress(stage, done, total)` callback drawing the bar (see the module docstring)."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.enabled = err.is_terminal and not quiet
        self.after = delay_s()
        self.start = time.monotonic()
        self.drawn = 0.0
        self.seen: set[str] = set()
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.bar is None:
            if now - self.start < self.after:
                return
            self._open(stage, total)
        if stage in self.seen and now - self.drawn < REDRAW_S:
            return
        self.seen.add(stage)
        self.drawn = now
        self.bar.update(self.task, description=stage, completed=done, total=total)
        self.bar.refresh()

    def validation(self) -> Callable[[int, int], None]:
        """The callback `validate` takes (runs done, runs in all), shown as stage "validate"."""
        return lambda done, total: self("validate", done, total)

    def _open(self, stage: str, total: int) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description:<8}"),
            BarColumn(),
            TaskProgressColumn(),
            console=err,
            transient=True,
            auto_refresh=False,
        )
        self.bar.start()
        self.task = self.bar.add_task(stage, total=total)

    def close(self) -> None:
        """Take the bar off the screen (it is transient)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
