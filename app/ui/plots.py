"""Geometry of the server-drawn SVG plots: a line chart, a bar chart, a heatmap.

Numbers in, coordinates out; the templates draw them (every label they
print is escaped there). No scripts, no styles in the SVG: presentation
attributes only, so the strict Content-Security-Policy holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.domain.projection.overview import RewardDistribution, RewardGroup

WIDTH, HEIGHT = 560, 200
LEFT, RIGHT, TOP, BOTTOM = 48, 12, 12, 36
# Heatmap shades, light to dark (a cell's share of the busiest cell).
SHADES = ("#eef3fb", "#c9dbf2", "#9fc0e8", "#6f9fd9", "#447cc4", "#265ca3", "#143f78", "#08234a")


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    label: str
    value: float
    axis: str  # the label shortened for the axis


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    points: list[Point]
    polyline: str
    y_ticks: list[tuple[float, str]]  # (y, text)
    x_labels: list[Point]  # a thinned subset of points, for axis text
    bar_width: float
    baseline: float


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** np.floor(np.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def chart(labels: list[str], values: list[float], y_max: float | None = None,
          max_labels: int = 8, axis: list[str] | None = None) -> Chart:
    """Points of `values` over evenly spaced `labels` (a line or one bar each);
    `axis` are shorter texts for the x axis (default: the labels cut to 12)."""
    short = axis if axis is not None else [label[:12] for label in labels]
    top = y_max if y_max is not None else _nice_max(max(values, default=0.0))
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    n = len(values)
    slot = plot_w / max(n, 1)
    points = [
        Point(x=round(LEFT + slot * (i + 0.5), 2),
              y=round(TOP + plot_h * (1 - min(v, top) / top), 2), label=label, value=v,
              axis=short[i])
        for i, (label, v) in enumerate(zip(labels, values, strict=True))
    ]
    ticks = [(round(TOP + plot_h * (1 - f), 2), f"{top * f:.3g}") for f in (0, 0.25, 0.5, 0.75, 1)]
    every = max(1, -(-n // max_labels))
    return Chart(
        width=WIDTH, height=HEIGHT, points=points,
        polyline=" ".join(f"{p.x},{p.y}" for p in points),
        y_ticks=ticks, x_labels=points[::every],
        bar_width=round(max(slot * 0.6, 1.0), 2), baseline=TOP + plot_h,
    )


@dataclass(frozen=True)
class Heatmap:
    layers: int
    experts: int
    cell: int
    width: int
    height: int
    shades: list[tuple[str, str]]  # (fill, SVG path of the cells in that shade)
    busiest: int


def heatmap(counts: np.ndarray, cell: int | None = None) -> Heatmap:
    """Layers as rows, experts as columns; one path per shade keeps the SVG small.
    Cells shrink with the expert count so a picture stays about 320 px wide."""
    layers, experts = counts.shape
    if cell is None:
        cell = max(2, min(10, 320 // max(experts, 1)))
    busiest = int(counts.max()) if counts.size else 0
    paths: list[list[str]] = [[] for _ in SHADES]
    if busiest > 0:
        level = np.ceil(counts / busiest * len(SHADES)).astype(int) - 1
        for layer, expert in zip(*np.nonzero(counts), strict=True):
            paths[level[layer, expert]].append(
                f"M{expert * cell} {layer * cell}h{cell}v{cell}h-{cell}z")
    return Heatmap(layers=layers, experts=experts, cell=cell, width=max(experts, 1) * cell,
                   height=max(layers, 1) * cell, busiest=busiest,
                   shades=[(shade, "".join(cells)) for shade, cells in zip(SHADES, paths,
                                                                          strict=True) if cells])


@dataclass(frozen=True)
class Histogram:
    """One weight version's reward histogram: bars over the run's shared reward range."""

    width: int
    height: int
    bars: list[tuple[float, float, float, int, str]]  # x, y, height, count, range text


HIST_W, HIST_H = 120, 28


def reward_histograms(dist: RewardDistribution) -> list[tuple[RewardGroup, Histogram]]:
    """A small histogram per weight version, all on one x range and one y scale (the
    busiest bin of any version), so the versions compare at a glance."""
    tallest = max((max(g.histogram) for g in dist.groups), default=0) or 1
    bins = len(dist.groups[0].histogram) if dist.groups else 0

    def edge(i: int) -> float:
        # Weighted, not low + i * (high - low) / bins: a range past float64 (rewards of
        # ±1e308) made the step inf and the edges inf and nan.
        return dist.low * (1 - i / bins) + dist.high * (i / bins)

    slot = HIST_W / max(bins, 1)
    out = []
    for group in dist.groups:
        bars = []
        for i, count in enumerate(group.histogram):
            height = round((HIST_H - 2) * count / tallest, 2)
            bars.append((round(slot * i + 1, 2), round(HIST_H - height, 2), height, count,
                         f"[{edge(i):.3g}, {edge(i + 1):.3g}{']' if i == bins - 1 else ')'}"))
        out.append((group, Histogram(HIST_W, HIST_H, bars)))
    return out
