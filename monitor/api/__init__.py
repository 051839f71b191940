"""HTTP routers of the tailwatch service; each reads app state through `monitor.api.deps`."""
