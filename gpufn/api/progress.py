"""`.map` progress: one bar, in a terminal (rich) or in Jupyter (a display updated in
place: text/html plus text/plain, so it needs no ipywidgets and raises no warning)."""

from __future__ import annotations

import html
import sys
import time
from typing import Any, Protocol

UPDATE_SECONDS = 0.1  # a notebook bar redraws at most this often (and once at the end)


class Bar(Protocol):
    def advance(self) -> None: ...
    def close(self) -> None: ...


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where rich would want ipywidgets for a live bar)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Snapshot:
    """What the notebook shows: rich HTML for the browser, plain text for everything else."""

    def __init__(self, name: str, done: int, total: int | None, elapsed: float) -> None:
        self.name, self.done, self.total, self.elapsed = name, done, total, elapsed

    def _numbers(self) -> tuple[str, str, str]:
        rate = self.done / self.elapsed if self.elapsed > 0 else 0.0
        eta = ((self.total - self.done) / rate if rate and self.total is not None else None)
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        return count, rate_text(self.done, self.elapsed), _clock(eta if self.done != self.total else 0.0)

    def __repr__(self) -> str:
        count, rate, eta = self._numbers()
        width = 30
        filled = width if not self.total else int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        return f"{self.name} [{bar}] {count} {rate} elapsed {_clock(self.elapsed)} ETA {eta}"

    def _repr_html_(self) -> str:
        count, rate, eta = self._numbers()
        value = f' value="{self.done}" max="{self.total}"' if self.total else ""
        return (f"<div style='font-family:monospace'><b>{html.escape(self.name)}</b> "
                f"<progress{value} style='width:40%'></progress> {count} · {rate} · "
                f"elapsed {_clock(self.elapsed)} · ETA {eta}</div>")


class NotebookBar:
    def __init__(self, name: str, total: int | None) -> None:
        from IPython.display import display

        self.name, self.total, self.done = name, total, 0
        self.start = time.monotonic()
        self.shown = 0.0
        self.handle: Any = display(self._snapshot(), display_id=True)

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(self.name, self.done, self.total, time.monotonic() - self.start)

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.shown >= UPDATE_SECONDS:
            self.shown = now
            self.handle.update(self._snapshot())

    def close(self) -> None:
        self.handle.update(self._snapshot())


def rate_text(done: int, elapsed: float) -> str:
    """Calls per second so far, as both bars show it ("12.5/s")."""
    return f"{done / elapsed if elapsed > 0 else 0.0:.1f}/s"


class TerminalBar:
    def __init__(self, name: str, total: int | None) -> None:
        from rich.markup import escape
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class RateColumn(ProgressColumn):
            """Completed calls per second, over the whole run (as the notebook bar shows)."""

            def render(self, task: Any) -> Text:
                elapsed = task.finished_time if task.finished else task.elapsed
                return Text(rate_text(int(task.completed), elapsed or 0.0), style="cyan")

        self.progress = Progress(TextColumn(f"[bold]{escape(name)}"), BarColumn(),
                                 MofNCompleteColumn(), RateColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("map", total=total)
        self.progress.start()

    def advance(self) -> None:
        self.progress.advance(self.task)

    def close(self) -> None:
        self.progress.stop()


def make_bar(name: str, total: int | None) -> Bar:
    return NotebookBar(name, total) if in_notebook() else TerminalBar(name, total)
