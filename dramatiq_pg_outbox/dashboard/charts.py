"""Server-side SVG charts: geometry only; ``templates/_charts.html`` draws it.

A chart here is numbers (pixel coordinates, tick positions) and labels; the
template writes the SVG elements, so every label an actor or queue name
reaches goes through Jinja2's autoescaping like the rest of the page.  No
JavaScript is involved.

Tick values follow Heckbert's "Nice numbers for graph labels" (Graphics Gems,
1990): steps of 1, 2, 2.5 or 5 times a power of ten.  Colours are the
Okabe-Ito palette (distinguishable with the common colour-vision deficiencies).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from .store import StatRow

#: Okabe & Ito (2008), "Color Universal Design", ordered for contrast on white.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")

#: Candidate steps of a time axis, in seconds.
_TIME_STEPS = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


@dataclass(frozen=True)
class Series:
    """A named series of (UTC time, value) points; ``None`` is a gap (no data in that bucket)."""

    label: str
    points: Sequence[tuple[dt.datetime, float | None]]
    dashed: bool = False
    color: str | None = None


@dataclass(frozen=True)
class Line:
    """A series in pixels: polylines (``points`` attribute strings) and lone points between gaps."""

    label: str
    color: str
    dashed: bool
    segments: list[str]
    dots: list[tuple[float, float]]


@dataclass(frozen=True)
class Chart:
    """Everything the template needs to draw one line chart (sizes in pixels)."""

    title: str
    unit: str
    width: int
    height: int
    left: int
    top: int
    plot_width: int
    plot_height: int
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    lines: list[Line]

    @property
    def empty(self) -> bool:
        return not any(line.segments or line.dots for line in self.lines)


def nice_ticks(maximum: float, count: int = 4) -> list[float]:
    """Tick values from 0 to at least ``maximum``, about ``count`` steps of a "nice" size.

    Parameters:
      maximum(float): The largest value to show; values <= 0 give the ticks of 1.
      count(int): The wanted number of steps. Default 4.

    Returns:
      list[float]: ``[0, step, 2 step, ...]``, the last one >= ``maximum``.
    """
    if not maximum > 0 or not math.isfinite(maximum):
        maximum = 1.0
    raw = maximum / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = 10 * magnitude
    for multiple in (1, 2, 2.5, 5, 10):
        if multiple * magnitude >= raw:
            step = multiple * magnitude
            break
    steps = math.ceil(maximum / step - 1e-9)
    return [i * step for i in range(steps + 1)]


def format_number(value: float) -> str:
    """A short axis label: ``0``, ``0.25``, ``12``, ``1.5k``, ``2M``."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    if value == int(value):
        return str(int(value))
    return f"{value:.3g}"


#: Units of a duration axis: (label, milliseconds), the largest that fits is used.
DURATION_UNITS = (("d", 86_400_000.0), ("h", 3_600_000.0), ("min", 60_000.0), ("s", 1_000.0), ("ms", 1.0))


def duration_unit(maximum_ms: float) -> tuple[str, float]:
    """(label, size in ms) of the unit a duration axis reading up to ``maximum_ms`` is drawn in.

    The largest unit of which the maximum is at least two: a wait of days reads
    in days or hours, never as "800k ms"; below 2 ms, milliseconds.
    """
    return next(((label, size) for label, size in DURATION_UNITS if maximum_ms >= 2 * size), ("ms", 1.0))


def time_ticks(start: dt.datetime, end: dt.datetime, count: int = 6) -> list[tuple[dt.datetime, str]]:
    """Round UTC times between ``start`` and ``end``, at most about ``count`` of them, with labels."""
    span = max((end - start).total_seconds(), 1.0)
    step = next(
        (s for s in _TIME_STEPS if span / s <= count), _TIME_STEPS[-1] * math.ceil(span / 86400 / count)
    )
    first = math.ceil(start.timestamp() / step) * step
    if step < 60:
        fmt = "%H:%M:%S"
    elif span > 86400:
        fmt = "%m-%d %H:%M"
    else:
        fmt = "%H:%M"
    ticks = []
    t = first
    while t <= end.timestamp():
        moment = dt.datetime.fromtimestamp(t, dt.timezone.utc)
        ticks.append((moment, moment.strftime(fmt)))
        t += step
    return ticks


def line_chart(
    title: str,
    unit: str,
    series: Sequence[Series],
    start: dt.datetime,
    end: dt.datetime,
    width: int = 720,
    height: int = 220,
) -> Chart:
    """Lay out a line chart of ``series`` over the time window [``start``, ``end``].

    Parameters:
      title(str): Shown above the chart.
      unit(str): Unit of the values (shown with the title), e.g. ``msgs/s``; ``ms``
        marks a duration, drawn in the unit :func:`duration_unit` picks (s, min, h, d).
      series(Sequence[Series]): The lines; colours default to :data:`PALETTE` in order.
      start, end(datetime): The time window (timezone-aware).
      width, height(int): Size of the whole SVG in pixels.

    Returns:
      Chart: The geometry; the y axis starts at 0 and ends at a nice value >= the largest point.
    """
    left, right, top, bottom = 48, 12, 10, 24
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for s in series for _, v in s.points if v is not None]
    scale = 1.0
    if unit == "ms":
        unit, scale = duration_unit(max(values, default=0.0))
    y_values = nice_ticks(max(values, default=0.0) / scale)
    y_max = y_values[-1] * scale
    t0, t1 = start.timestamp(), max(end.timestamp(), start.timestamp() + 1)

    def x_of(moment: dt.datetime) -> float:
        return round(left + (moment.timestamp() - t0) / (t1 - t0) * plot_w, 1)

    def y_of(value: float) -> float:
        return round(top + plot_h - value / y_max * plot_h, 1)

    lines = []
    for i, s in enumerate(series):
        segments: list[str] = []
        dots: list[tuple[float, float]] = []
        run: list[tuple[float, float]] = []
        for moment, value in [*s.points, (end, None)]:
            if value is not None and t0 <= moment.timestamp() <= t1:
                run.append((x_of(moment), y_of(value)))
                continue
            if len(run) > 1:
                segments.append(" ".join(f"{x},{y}" for x, y in run))
            elif run:
                dots.append(run[0])
            run = []
        color = s.color or PALETTE[i % len(PALETTE)]
        lines.append(Line(s.label, color, s.dashed, segments, dots))
    return Chart(
        title=title,
        unit=unit,
        width=width,
        height=height,
        left=left,
        top=top,
        plot_width=plot_w,
        plot_height=plot_h,
        x_ticks=[(x_of(moment), label) for moment, label in time_ticks(start, end)],
        y_ticks=[(y_of(v * scale), format_number(v)) for v in y_values],
        lines=lines,
    )


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int
    label: str


def sparkline(
    counts: dict[dt.datetime, int], end: dt.datetime, minutes: int = 60, width: int = 120, height: int = 24
) -> list[Bar]:
    """One bar per minute of the last ``minutes`` before ``end`` (missing minutes are 0).

    Parameters:
      counts(dict[datetime, int]): Count per minute start (UTC, aligned to the minute).
      end(datetime): The database's "now".
      minutes(int): How many minutes; default 60.
      width, height(int): Size in pixels.

    Returns:
      list[Bar]: Bars (only minutes with a count > 0), scaled to the largest count.
    """
    last = end.replace(second=0, microsecond=0)
    starts = [last - dt.timedelta(minutes=minutes - 1 - i) for i in range(minutes)]
    peak = max(counts.values(), default=0)
    if peak == 0:
        return []
    slot = width / minutes
    bars = []
    for i, minute in enumerate(starts):
        n = counts.get(minute, 0)
        if n:
            h = max(1.0, n / peak * height)
            bars.append(Bar(round(i * slot, 2), round(height - h, 2), round(slot * 0.8, 2), round(h, 2), n,
                            minute.strftime("%H:%M")))  # fmt: skip
    return bars


@dataclass(frozen=True)
class ActorCharts:
    """The charts page: throughput and errors of the busiest actors, and each one's latency."""

    throughput: Chart
    errors: Chart
    latency: list[Chart]
    #: actor -> (finished deliveries, failed) in the window, for the drawn actors.
    totals: dict[str, tuple[int, int]]
    #: Actors with deliveries in the window that were not drawn (beyond ``max_actors``).
    hidden: list[str]


def actor_charts(
    stats: Sequence[StatRow],
    start: dt.datetime,
    end: dt.datetime,
    bucket: dt.timedelta,
    bucket_label: str,
    max_actors: int = 8,
) -> ActorCharts:
    """Lay out the charts of ``message_stats(bucket, start)`` rows over [``start``, ``end``].

    Buckets without rows count as 0 messages (throughput, errors) and as gaps
    in the latency lines (unknown, not zero).  The ``max_actors`` actors with
    the most deliveries are drawn, each in the same colour in every chart.

    Parameters:
      stats(Sequence[StatRow]): Rows of ``message_stats()``, buckets aligned on the Unix epoch.
      start, end(datetime): The window (``end`` is the database's "now").
      bucket(timedelta): The bucket size given to ``message_stats()``.
      bucket_label(str): How to name a bucket in a title, e.g. ``15 s``.
      max_actors(int): Most actors drawn.  Default 8.

    Returns:
      ActorCharts: The charts and the per-actor totals.
    """
    by_actor: dict[str, list[StatRow]] = {}
    for row in stats:
        by_actor.setdefault(row.actor_name, []).append(row)
    drawn = sorted(sorted(by_actor, key=lambda a: (-sum(r.deliveries for r in by_actor[a]), a))[:max_actors])
    colors = {actor: PALETTE[i % len(PALETTE)] for i, actor in enumerate(drawn)}
    # The bucket starts of message_stats(): whole buckets from the epoch (date_bin(bucket, ts, epoch)).
    step = bucket.total_seconds()
    first = dt.datetime.fromtimestamp(start.timestamp() // step * step, dt.timezone.utc)
    slots = []
    while first <= end:
        slots.append(first)
        first += bucket

    def on_slots(
        actor: str, value: Callable[[StatRow], float | None], missing: float | None
    ) -> list[tuple[dt.datetime, float | None]]:
        found = {r.bucket_start: value(r) for r in by_actor[actor]}
        return [(slot, found.get(slot, missing)) for slot in slots]

    throughput = line_chart(
        "Throughput per actor",
        "messages/s",
        [Series(a, on_slots(a, lambda r: r.throughput_per_s, 0.0), color=colors[a]) for a in drawn],
        start,
        end,
    )
    errors = line_chart(
        f"Errors per actor (failed + retried, per {bucket_label})",
        "messages",
        [Series(a, on_slots(a, lambda r: r.failed + r.retried, 0.0), color=colors[a]) for a in drawn],
        start,
        end,
    )
    latency = []
    for actor in drawn:
        lines = [
            ("wait p50", "wait_p50_ms", False, PALETTE[0]),
            ("wait p99", "wait_p99_ms", True, PALETTE[0]),
            ("run p50", "run_p50_ms", False, PALETTE[3]),
            ("run p99", "run_p99_ms", True, PALETTE[3]),
        ]
        series = [
            Series(label, on_slots(actor, attrgetter(field), None), dashed=dashed, color=color)
            for label, field, dashed, color in lines
        ]
        latency.append(line_chart(actor, "ms", series, start, end, height=180))
    totals = {a: (sum(r.deliveries for r in by_actor[a]), sum(r.failed for r in by_actor[a])) for a in drawn}
    return ActorCharts(throughput, errors, latency, totals, sorted(set(by_actor) - set(drawn)))
