"""Every metric the Grafana dashboard queries appears on the running CPU server's metrics port."""

from __future__ import annotations

import json
import re

from helpers import ROOT
from helpers.clients import http_generate
from helpers.server import scrape

from avspec.serving.host.server_process import ServerProcess

DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "adaptive_verification.json"
METRIC = re.compile(r"\b((?:av|nv)_[a-z_]+)\b")


def test_dashboard_queries_only_metrics_the_server_exports(server: ServerProcess) -> None:
    http_generate(server.http_url, text_input="def ", max_tokens=8)  # every counter has moved
    exported = {name for name, _labels in scrape(server)}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in METRIC.findall(target["expr"])
    }
    assert queried, "the dashboard queries no metric"
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
