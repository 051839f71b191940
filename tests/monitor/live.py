"""Run a tailwatch app under a real uvicorn on a free loopback port (in a thread)."""

from monitor.demo.server import ServiceThread as LiveServer

__all__ = ["LiveServer"]
