"""Figures of the studies (docs/design.md#studies): one way to open, finish and save them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(
    path: str | Path, panels: int = 1, *, size: tuple[float, float] = (7, 4.5), title: str = ""
) -> Iterator[list[Any]]:
    """Axes of a figure with ``panels`` side by side (shared y); on exit each gets a grid and
    a legend, and the figure is saved to ``path`` as a PNG (100 dpi) and closed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    canvas, grid = plt.subplots(
        1, panels, figsize=(size[0] * panels, size[1]), squeeze=False, sharey=True
    )
    try:
        yield list(grid[0])
        for axes in grid[0]:
            axes.grid(alpha=0.3)
            axes.legend(fontsize=8)
        if title:
            canvas.suptitle(title)
        canvas.tight_layout()
        canvas.savefig(path, dpi=100)
    finally:
        plt.close(canvas)


def log_epsilon_axis(axes: Any, label: str) -> None:
    """A log ε axis with plain numbers at 1, 2 and 5 × 10^k and no minor labels."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel(label)
