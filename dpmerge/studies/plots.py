"""Figures of the studies (docs/design.md#studies): one way to open, finish and save them.

Every figure is finished the same way, so that what it shows can be read: the legend sits
outside the axes (it never covers data); lines that coincide stay visible (each later line is
drawn thinner and dashed on top of the earlier ones, with its own marker); titles are wrapped
to fit the canvas.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DASHES = ("-", (0, (6, 2)), (0, (3, 2, 1, 2)), (0, (1.5, 1.5)))
STEP = 1.0
"""Extra line width (points) of each line over the next one drawn: coinciding lines show as
nested bands, and the dashes of the thinner ones let the wider ones show through."""


@contextmanager
def figure(
    path: str | Path, panels: int = 1, *, size: tuple[float, float] = (7, 4.5), title: str = ""
) -> Iterator[list[Any]]:
    """Axes of a figure with ``panels`` side by side (shared y); on exit each gets a grid, its
    lines staggered and a legend outside it, titles are fitted to the canvas, and the figure
    is saved to ``path`` as a PNG (100 dpi) and closed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    canvas, grid = plt.subplots(
        1, panels, figsize=(size[0] * panels + 2.5, size[1]), squeeze=False, sharey=True
    )
    try:
        yield list(grid[0])
        for axes in grid[0]:
            axes.grid(alpha=0.3)
            _stagger(axes)
            if axes.get_legend_handles_labels()[0]:
                axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if title:
            canvas.suptitle(title)
        _fit_titles(canvas, grid[0])
        canvas.tight_layout()
        canvas.savefig(path, dpi=100)
    finally:
        plt.close(canvas)


def _stagger(axes: Any) -> None:
    """Later lines thinner, dashed and on top, each with its own marker: a line that
    coincides with an earlier one leaves that one's edges, gaps and markers visible."""
    lines = [line for line in axes.get_lines() if not line.get_label().startswith("_")]
    lines += [
        container.lines[0]
        for container in axes.containers
        if hasattr(container, "has_xerr") and not container.get_label().startswith("_")
    ]
    drawn = sorted((line for line in lines if line is not None), key=_drawn_order)
    lines = [line for line in drawn if line.get_linestyle() not in ("None", "", " ")]
    count = len(lines)
    for i, line in enumerate(lines):
        spare = STEP * (count - 1 - i)
        line.set_linewidth(line.get_linewidth() + spare)
        line.set_linestyle(DASHES[i % len(DASHES)])
        if line.get_marker() not in (None, "None", "", " "):
            line.set_marker(MARKERS[i % len(MARKERS)])
            line.set_markersize(line.get_markersize() + spare)
        line.set_zorder(2 + i / max(count, 1))


def _drawn_order(line: Any) -> int:
    return line.axes.get_children().index(line)


def _fit_titles(canvas: Any, panels: Any) -> None:
    """Wrap each axes title (and the figure's) so it fits the width it is drawn in."""
    renderer = canvas.canvas.get_renderer()
    pieces = [(axes.title, axes.get_window_extent(renderer).width) for axes in panels]
    if canvas._suptitle is not None:
        pieces.append((canvas._suptitle, canvas.bbox.width))
    for text, width in pieces:
        words = text.get_text()
        if not words:
            continue
        for columns in range(len(words), 10, -4):
            text.set_text(textwrap.fill(words, columns))
            if text.get_window_extent(renderer).width <= width:
                break


def log_epsilon_axis(axes: Any, label: str) -> None:
    """A log ε axis with plain numbers at 1, 2 and 5 × 10^k and no minor labels."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel(label)
