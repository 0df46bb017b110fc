"""Compatibility module: `least-loaded` now lives in least_pressure.py (same policy)."""

from talaria.services.router.policy.least_pressure import LeastLoaded, LeastPressure, load_of

__all__ = ["LeastLoaded", "LeastPressure", "load_of"]
