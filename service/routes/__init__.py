"""Routers, split by concern: compute, catalog (ops, devices), health (and metrics)."""
