"""Grafana's JSON dashboard model (schema 39) built from compact panel lists: the data types
the dashboards are written in (``dashboards.py``) and the builder that turns them into the JSON
Grafana imports. Kept apart from the dashboards themselves so each file has one job."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

RI = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    """One time-series (or stat) panel: title, unit, (query, legend) pairs, description."""

    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]
    description: str = ""
    kind: str = "timeseries"


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    variables: tuple[tuple[str, str], ...] = field(default=())


def rate(expr: str) -> str:
    return f"rate({expr}{RI})"


def sel(metric: str, labels: str, *extra: str) -> str:
    """``metric{labels, extra...}``."""
    return metric + "{" + ", ".join((labels, *extra)) + "}"


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"var-{name}"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "sort": 1,
    }


def panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
                "refId": chr(ord("A") + i),
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def build(d: Dashboard) -> dict:
    """The Grafana JSON model of ``d`` (schema 39): a row per group, panels two abreast."""
    panels: list[dict] = []
    y = 0
    pid = 1
    for title, row in d.rows:
        panels.append(
            {"id": pid, "type": "row", "title": title, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        )  # fmt: skip
        pid += 1
        y += 1
        for i, panel in enumerate(row):
            panels.append(panel_json(panel, pid, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(row) + 1) // 2)
    datasource = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["kserve_trio"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "templating": {"list": [datasource, *(variable(n, q) for n, q in d.variables)]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    return json.dumps(build(d), indent=2) + "\n"


__all__ = ["Dashboard", "Panel", "build", "rate", "render", "sel"]
