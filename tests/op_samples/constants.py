"""Samples for the constants group (see tests/op_samples/__init__.py)."""

SAMPLES: dict = {}
TORCH: dict = {}
ERRORS: dict = {}
