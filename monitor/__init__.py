"""Wiring: settings, the FastAPI service, scheduler, Prometheus metrics, reports and the CLI."""
