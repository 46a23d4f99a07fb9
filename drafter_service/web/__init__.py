"""The HTTP side: Prometheus metrics, a time series of speedup per namespace, and the dashboard."""

from drafter_service.web.http_server import DashboardServer
from drafter_service.web.metrics import metrics_registry
from drafter_service.web.timeseries import MetricsRollup

__all__ = ["DashboardServer", "MetricsRollup", "metrics_registry"]
