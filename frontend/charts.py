"""Plotly figure builders: pure functions from page data to figure dicts (data + layout).

Templates embed the dicts as JSON and frontend/static/frontend/meridian.js draws them with
the plotly.js that ships inside the Python package, so no chart needs a network fetch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from controlplane.core.money import format_usd
from controlplane.costs.services import IDLE_TENANT
from frontend.fleet import (
    DEGRADED,
    DOWN,
    HEALTH_MEANING,
    HEALTH_ORDER,
    HEALTHY,
    IDLE,
    STARTING,
    EdgeStatus,
    RegionStatus,
)
from frontend.traffic import Series

Figure = dict[str, Any]

HEALTH_COLOURS = {
    HEALTHY: "#1f9d55",
    DEGRADED: "#d69e2e",
    DOWN: "#c53030",
    STARTING: "#3182ce",
    IDLE: "#a0aec0",
}
EDGE_COLOUR = "#6b46c1"
INK = "#1a202c"
MUTED = "#718096"
GRID = "#e2e8f0"
HOUR_MS = 3_600_000
FONT = {"family": "system-ui, -apple-system, 'Segoe UI', sans-serif", "size": 12, "color": INK}


def _time(value: datetime) -> str:
    # plotly.js ignores UTC offsets in date strings, so every axis is labelled UTC instead.
    return value.strftime("%Y-%m-%d %H:%M:%S")


def marker_size(replicas: int) -> float:
    """Marker diameter in px: area grows with the replica count, within readable bounds."""
    if replicas <= 0:
        return 6.0
    return round(min(10 + 5 * math.sqrt(replicas), 42), 1)


def _region_hover(region: RegionStatus) -> str:
    states = ", ".join(f"{n} {state}" for state, n in region.counts.items()) or "no replicas"
    cost = f"<br>${region.usd_h:,.2f}/h" if region.usd_h else ""
    return (f"<b>{region.name}</b> · {region.key}<br>{region.cloud} · {region.jurisdiction}"
            f"<br>{region.health}: {states}{cost}")


# Drawing order of the region traces (plotly draws later traces on top).
DRAW_ORDER = (IDLE, STARTING, HEALTHY, DEGRADED, DOWN)
# A region in trouble is drawn at least this big: bigger than an edge's diamond (13).
TROUBLE_MIN_SIZE = 18.0


def world_map(regions: Sequence[RegionStatus], edges: Sequence[EdgeStatus]) -> Figure:
    """Regions coloured by health and sized by their replicas (terminated ones aside);
    edges with lines to the regions their newest table routes to."""
    data: list[dict[str, Any]] = []
    routes = _route_trace(regions, edges)
    if routes is not None:
        data.append(routes)
    if edges:
        data.append(_edge_trace(edges))
    # Regions are drawn after the edges, the worst last, so a diamond never hides a region
    # and a down region sits on top of everything near it.
    data += _region_traces(regions)
    return {"data": data, "layout": _map_layout()}


def _route_trace(regions: Sequence[RegionStatus], edges: Sequence[EdgeStatus]) -> Figure | None:
    """A line from each edge to each region its newest table routes to; None without any."""
    where = {r.key: (r.longitude, r.latitude) for r in regions}
    lon: list[float | None] = []
    lat: list[float | None] = []
    for edge in edges:
        for key in edge.routes:
            if key in where:
                lon += [edge.longitude, where[key][0], None]
                lat += [edge.latitude, where[key][1], None]
    if not lon:
        return None
    return {
        "type": "scattergeo", "mode": "lines", "name": "routes (edge → region)",
        "lon": lon, "lat": lat, "hoverinfo": "skip",
        "line": {"width": 1.2, "color": EDGE_COLOUR}, "opacity": 0.45,
    }


def _edge_trace(edges: Sequence[EdgeStatus]) -> Figure:
    return {
        "type": "scattergeo", "mode": "markers", "name": f"edges ({len(edges)})",
        "lon": [e.longitude for e in edges], "lat": [e.latitude for e in edges],
        "text": [
            f"<b>edge {e.name}</b> · {e.region}<br>table v{e.latest_version or '–'}, "
            f"acked v{e.acked_version or '–'} ({'in sync' if e.in_sync else 'behind'})"
            f"<br>routes to {len(e.routes)} region(s)"
            for e in edges
        ],
        "hoverinfo": "text",
        "marker": {"symbol": "diamond", "size": 13, "color": EDGE_COLOUR,
                   "line": {"width": 1.5, "color": "#ffffff"}},
    }


def _region_traces(regions: Sequence[RegionStatus]) -> list[Figure]:
    """One trace per health, in DRAW_ORDER."""
    traces = []
    for health in DRAW_ORDER:
        members = [r for r in regions if r.health == health]
        if not members:
            continue
        least = TROUBLE_MIN_SIZE if health in (DOWN, DEGRADED) else 0.0
        traces.append({
            "type": "scattergeo", "mode": "markers",
            "name": f"{health} ({len(members)})",
            "lon": [r.longitude for r in members], "lat": [r.latitude for r in members],
            "text": [_region_hover(r) for r in members], "hoverinfo": "text",
            "customdata": [r.key for r in members],
            "marker": {
                "size": [max(marker_size(r.replicas), least) for r in members],
                "color": HEALTH_COLOURS[health],
                "opacity": 0.55 if health == IDLE else 0.9,
                "line": {"width": 2 if health == DOWN else 1, "color": "#ffffff"},
            },
        })
    return traces


def _map_layout() -> dict[str, Any]:
    return {
        "height": 500,
        "margin": {"l": 0, "r": 0, "t": 0, "b": 0},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "font": FONT,
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "y": -0.02, "yanchor": "top",
                   "bgcolor": "rgba(255,255,255,0.8)"},
        "geo": {
            "scope": "world", "resolution": 110,
            "projection": {"type": "natural earth"},
            "showframe": False, "showcoastlines": True, "coastlinecolor": "#a0aec0",
            "showland": True, "landcolor": "#edf2f7",
            "showocean": True, "oceancolor": "#f7fafc",
            "showcountries": True, "countrycolor": "#cbd5e0",
            "lataxis": {"range": [-57, 80]},
            "bgcolor": "rgba(0,0,0,0)",
        },
    }


def health_legend() -> list[tuple[str, str, str]]:
    """(health, colour, meaning) for the legend under the map."""
    return [(h, HEALTH_COLOURS[h], HEALTH_MEANING[h]) for h in HEALTH_ORDER]


def _time_layout(y_title: str, height: int = 240, since: datetime | None = None,
                 until: datetime | None = None) -> dict[str, Any]:
    xaxis: dict[str, Any] = {"type": "date", "gridcolor": GRID, "hoverformat": "%H:%M:%S UTC"}
    if since and until:
        # The whole window, so a series that started recently reads as recent.
        xaxis["range"] = [_time(since), _time(until)]
    return {
        "height": height,
        "margin": {"l": 56, "r": 12, "t": 8, "b": 40},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": FONT,
        "hovermode": "x unified",
        "legend": {"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        "xaxis": xaxis,
        "yaxis": {"title": {"text": y_title}, "gridcolor": GRID, "rangemode": "tozero"},
    }


def _line(name: str, times: list[str], values: Sequence[float | None], colour: str,
          dash: str = "solid", axis: str = "y") -> dict[str, Any]:
    return {"type": "scatter", "mode": "lines", "name": name, "x": times, "y": list(values),
            "line": {"color": colour, "width": 2, "dash": dash}, "yaxis": axis,
            "connectgaps": False}


def _slo_line(name: str, span: list[str], value: float, colour: str) -> dict[str, Any]:
    return {"type": "scatter", "mode": "lines", "name": name, "x": span,
            "y": [value, value], "hoverinfo": "skip",
            "line": {"color": colour, "width": 1, "dash": "dot"}}


def latency_figure(series: Series, slo_ttft_ms: float, slo_itl_ms: float) -> Figure:
    """TTFT and ITL p95 per step against the deployment's SLO targets."""
    times = [_time(t) for t in series.times]
    data = [
        _line("TTFT p95", times, series.ttft_p95_ms, "#2b6cb0"),
        _line("ITL p95", times, series.itl_p95_ms, "#dd6b20"),
    ]
    if times:
        span = ([_time(series.since), _time(series.until)] if series.since and series.until
                else [times[0], times[-1]])
        data += [_slo_line(f"TTFT SLO {slo_ttft_ms:g} ms", span, slo_ttft_ms, "#2b6cb0"),
                 _slo_line(f"ITL SLO {slo_itl_ms:g} ms", span, slo_itl_ms, "#dd6b20")]
    layout = _time_layout("milliseconds", since=series.since, until=series.until)
    return {"data": data, "layout": layout}


def throughput_figure(series: Series) -> Figure:
    """Requests/s (left axis) and generated tokens/s (right axis)."""
    times = [_time(t) for t in series.times]
    layout = _time_layout("requests/s", since=series.since, until=series.until)
    layout["yaxis2"] = {"title": {"text": "tokens/s"}, "overlaying": "y", "side": "right",
                        "rangemode": "tozero", "showgrid": False}
    layout["margin"]["r"] = 56
    return {
        "data": [
            _line("requests/s", times, series.requests_per_s, "#2f855a"),
            _line("generated tokens/s", times, series.tokens_per_s, "#805ad5", dash="dot",
                  axis="y2"),
        ],
        "layout": layout,
    }


def load_figure(series: Series) -> Figure:
    """Requests running and waiting (the queue) summed over replicas."""
    times = [_time(t) for t in series.times]
    return {
        "data": [
            _line("running", times, series.running, "#2c7a7b"),
            _line("waiting (queue)", times, series.waiting, "#c53030"),
        ],
        "layout": _time_layout("requests", since=series.since, until=series.until),
    }


def kv_figure(series: Series) -> Figure:
    """KV cache usage: the mean over replicas and the fullest replica."""
    times = [_time(t) for t in series.times]
    layout = _time_layout("KV cache used (%)", since=series.since, until=series.until)
    layout["yaxis"]["range"] = [0, 100]
    layout["yaxis"].pop("rangemode")
    return {
        "data": [
            _line("mean", times, series.kv_usage_mean_pct, "#3182ce"),
            _line("fullest replica", times, series.kv_usage_max_pct, "#e53e3e", dash="dash"),
        ],
        "layout": layout,
    }


def events_figure(counts: Iterable[Mapping[str, Any]], since: datetime, until: datetime) -> Figure:
    """Audit events per hour, stacked by what they are about (replica, plan, tables …)."""
    by_kind: dict[str, dict[str, int]] = {}
    for row in counts:
        kind = row["kind"] or "other"
        by_kind.setdefault(kind, {})[_time(row["hour"])] = row["n"]
    palette = ["#3182ce", "#38a169", "#d69e2e", "#805ad5", "#e53e3e", "#319795", "#718096",
               "#dd6b20", "#b83280"]
    data = []
    for i, (kind, hours) in enumerate(sorted(by_kind.items())):
        data.append({"type": "bar", "name": kind, "x": list(hours), "y": list(hours.values()),
                     "marker": {"color": palette[i % len(palette)]},
                     # Bars start at the hour they count and are most of an hour wide.
                     "offset": 0, "width": HOUR_MS * 0.9})
    layout = _time_layout("events per hour", height=200, since=since, until=until)
    layout["barmode"] = "stack"
    layout["hovermode"] = "closest"
    return {"data": data, "layout": layout}


# -- costs ----------------------------------------------------------------------------------

COST_PALETTE = ["#3182ce", "#38a169", "#d69e2e", "#805ad5", "#e53e3e", "#319795", "#dd6b20",
                "#b83280", "#2c5282", "#276749"]
IDLE_COLOUR = "#a0aec0"


def _mtok(value: float | None) -> str:
    return "no tokens" if value is None else f"{format_usd(value, per_mtok=True)}/Mtok"


def spend_over_time_figure(rows: Iterable[Mapping[str, Any]], since: datetime, until: datetime,
                           bucket: str = "hour") -> Figure:
    """Spend per hour or day, stacked by model; rows of `time`, `model` and `usd`."""
    by_model: dict[str, dict[str, float]] = {}
    for row in rows:
        series = by_model.setdefault(row["model"], {})
        at = _time(row["time"])
        series[at] = series.get(at, 0.0) + float(row["usd"])
    width = HOUR_MS * (24 if bucket == "day" else 1) * 0.9
    totals = {model: sum(v.values()) for model, v in by_model.items()}
    data = []
    for i, model in enumerate(sorted(by_model, key=lambda m: (-totals[m], m))):
        points = by_model[model]
        data.append({"type": "bar", "name": model, "x": list(points), "y": list(points.values()),
                     "marker": {"color": COST_PALETTE[i % len(COST_PALETTE)]},
                     "offset": 0, "width": width,
                     "hovertemplate": f"{model}: $%{{y:,.2f}}<extra></extra>"})
    layout = _time_layout(f"$ per {bucket}", height=240, since=since, until=until)
    layout["barmode"] = "stack"
    return {"data": data, "layout": layout}


def spend_bars_figure(groups: Sequence[Mapping[str, Any]], what: str,
                      idle_name: str = "idle (no tokens)") -> Figure:
    """Horizontal bars of spend per model, region or tenant, the largest on top; hover shows
    tokens and $ per million tokens. A group keyed "(idle)" (or "") is idle cost, drawn
    grey."""
    ordered = sorted(groups, key=lambda g: float(g["usd"]))  # plotly draws bottom-up
    idle = [g["key"] in ("", IDLE_TENANT) for g in ordered]
    names = [idle_name if is_idle else g["key"] for g, is_idle in zip(ordered, idle, strict=True)]
    return {
        "data": [{
            "type": "bar", "orientation": "h", "name": what,
            "y": names, "x": [float(g["usd"]) for g in ordered],
            "marker": {"color": [IDLE_COLOUR if is_idle else COST_PALETTE[0] for is_idle in idle]},
            "customdata": [[f"{g['tokens']:,}", _mtok(g["usd_per_mtok"])] for g in ordered],
            "hovertemplate": ("%{y}: $%{x:,.2f}<br>%{customdata[0]} tokens · "
                              "%{customdata[1]}<extra></extra>"),
        }],
        "layout": {
            "height": max(120, 28 * len(ordered) + 60),
            "margin": {"l": 150, "r": 12, "t": 8, "b": 36},
            "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)", "font": FONT,
            "xaxis": {"title": {"text": "$"}, "gridcolor": GRID, "rangemode": "tozero"},
            "yaxis": {"automargin": True},
            "showlegend": False,
        },
    }


# -- failover ---------------------------------------------------------------------------------

STAGE_COLOURS = {"detected": "#e53e3e", "tables_pushed": "#d69e2e",
                 "replacement_ready": "#3182ce", "traffic_back": "#38a169", "resolved": "#718096"}
# Stages often land at the same moment: later ones are drawn smaller, on top, as rings.
STAGE_SIZES = {"detected": 18, "tables_pushed": 14, "replacement_ready": 11,
               "traffic_back": 8, "resolved": 5}


def incident_timeline_figure(incidents: Sequence[Mapping[str, Any]]) -> Figure:
    """Seconds from each failure (or drill) to each stage of Meridian's answer.

    `incidents`: newest first, each with a `label` and `timeline` ({stage_s: seconds|None}).
    One row per incident; a marker per stage reached, joined by a line from the start.
    """
    rows = list(reversed(incidents))  # oldest at the bottom, as a timeline reads
    labels = [row["label"] for row in rows]
    data: list[dict[str, Any]] = [{
        "type": "scatter", "mode": "lines", "showlegend": False, "hoverinfo": "skip",
        "x": [v for row in rows for v in (0, _last_stage(row["timeline"]), None)],
        "y": [v for label in labels for v in (label, label, None)],
        "line": {"color": "#cbd5e0", "width": 6},
    }]
    for stage, colour in STAGE_COLOURS.items():
        xs, ys = [], []
        for row, label in zip(rows, labels, strict=True):
            seconds = row["timeline"].get(f"{stage}_s")
            if seconds is not None:
                xs.append(seconds)
                ys.append(label)
        data.append({"type": "scatter", "mode": "markers", "name": stage.replace("_", " "),
                     "x": xs, "y": ys, "marker": {"color": colour, "size": STAGE_SIZES[stage],
                                                 "line": {"color": "#fff", "width": 1}},
                     "hovertemplate": f"{stage.replace('_', ' ')}: %{{x:.2f}} s<extra>%{{y}}</extra>"})
    height = 80 + 34 * max(len(rows), 1)
    return {"data": data, "layout": {
        "height": height, "margin": {"l": 220, "r": 20, "t": 40, "b": 40},
        "xaxis": {"title": {"text": "seconds after the failure"}, "rangemode": "tozero"},
        "yaxis": {"type": "category", "automargin": True},
        "legend": {"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        "hovermode": "closest",
        "plot_bgcolor": "#fff", "paper_bgcolor": "#fff",
    }}


def _last_stage(timeline: Mapping[str, float | None]) -> float:
    return max((v for v in timeline.values() if v is not None), default=0.0)


# -- batches --------------------------------------------------------------------------------


def batch_progress_figure(per_minute: Iterable[Mapping[str, Any]]) -> Figure:
    """A batch's lines finished so far over time, completed and failed, from rows of
    `minute`, `completed` and `failed` (lines finished in that minute)."""
    times: list[str] = []
    completed: list[float | None] = []
    failed: list[float | None] = []
    done = bad = 0
    for row in per_minute:
        done += int(row["completed"])
        bad += int(row["failed"])
        times.append(_time(row["minute"]))
        completed.append(done)
        failed.append(bad)
    data = [_line("completed", times, completed, "#2f855a"),
            _line("failed", times, failed, "#c53030")]
    for trace in data:
        trace["line"]["shape"] = "hv"
        trace["mode"] = "lines+markers"
    return {"data": data, "layout": _time_layout("lines finished", height=220)}


# -- rollouts -------------------------------------------------------------------------------

STABLE_COLOUR = "#3182ce"
CANARY_COLOUR = "#dd6b20"


def rollout_figure(rows: Sequence[Mapping[str, Any]], stable: int, canary: int) -> Figure:
    """The two revisions side by side at each step: TTFT p95 (ms) on the left, 5xx rate (%)
    on the right. `rows`: the steps in order, each a `label` and its analysis `figures`
    (`stable`/`canary` with `ttft_p95_s` and `error_rate`, None where unmeasured). TTFT
    counts successful answers only (a revision answering only errors has no bar), and its
    hover gives the 5xx rate beside it."""
    labels = [row["label"] for row in rows]

    def values(side: str, key: str, scale: float) -> list[float | None]:
        out: list[float | None] = []
        for row in rows:
            value = (row["figures"].get(side) or {}).get(key)
            out.append(round(value * scale, 3) if value is not None else None)
        return out

    data: list[dict[str, Any]] = []
    for side, number, colour in (("stable", stable, STABLE_COLOUR),
                                 ("canary", canary, CANARY_COLOUR)):
        name = f"revision {number} ({side})"
        data.append({"type": "bar", "name": name, "legendgroup": side, "x": labels,
                     "y": values(side, "ttft_p95_s", 1000.0), "marker": {"color": colour},
                     "customdata": values(side, "error_rate", 100.0),
                     "hovertemplate": f"{name}<br>TTFT p95 %{{y}} ms of successful answers"
                                      f"<br>5xx %{{customdata}}%<extra>step %{{x}}</extra>"})
        data.append({"type": "bar", "name": name, "legendgroup": side, "showlegend": False,
                     "x": labels, "y": values(side, "error_rate", 100.0),
                     "xaxis": "x2", "yaxis": "y2", "marker": {"color": colour},
                     "hovertemplate": f"{name}<br>5xx %{{y}}%<extra>step %{{x}}</extra>"})
    return {"data": data, "layout": {
        "height": 280, "barmode": "group", "font": FONT,
        "margin": {"l": 56, "r": 16, "t": 40, "b": 48},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "xaxis": {"domain": [0, 0.46], "type": "category", "title": {"text": "step: weight"}},
        "yaxis": {"title": {"text": "TTFT p95 (ms)"}, "gridcolor": GRID, "rangemode": "tozero"},
        "xaxis2": {"domain": [0.54, 1], "type": "category", "anchor": "y2",
                   "title": {"text": "step: weight"}},
        "yaxis2": {"title": {"text": "5xx (%)"}, "gridcolor": GRID, "rangemode": "tozero",
                   "anchor": "x2"},
        "legend": {"orientation": "h", "x": 0, "y": 1.04, "yanchor": "bottom"},
    }}
