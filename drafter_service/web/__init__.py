"""The HTTP side: Prometheus metrics, a time series of speedup per namespace, and the dashboard."""
