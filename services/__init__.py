"""Talaria services: gateway, router, instance agents, telemetry."""
