"""Placeholder routes for token positions without a captured route: `dummy_routes`, defined with
the route dtypes in the core (`r3lightning.routes`) and importable from here, its public path
since 0.2."""

from __future__ import annotations

from r3lightning.routes import dummy_routes

__all__ = ["dummy_routes"]
