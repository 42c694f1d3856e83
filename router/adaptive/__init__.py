"""Adaptive placement: the per-request placer and the cluster's layout search.

    placer.py           AdaptivePlacer: for each request, local or remote, on which instances
    placement_model.py  what each (prefill, decode) option is predicted to give
    layout_model.py     the cluster's layout for the window's traffic: how many prefill only
    latency_model.py    the profile's step model, corrected online by what the workers measure

Reasoning and evidence: docs/design/adaptive-placement.md.
"""

from __future__ import annotations

from router.adaptive.latency_model import LatencyModel
from router.adaptive.layout_model import Arrival, LayoutModel, Running
from router.adaptive.placement_model import InstanceView, Option, PlacementModel
from router.adaptive.placer import (
    WINDOW_S,
    AdaptivePlacer,
    Placement,
    RequestSLO,
    adaptive_placer,
)

__all__ = [
    "WINDOW_S",
    "AdaptivePlacer",
    "Arrival",
    "InstanceView",
    "LatencyModel",
    "LayoutModel",
    "Option",
    "Placement",
    "PlacementModel",
    "RequestSLO",
    "Running",
    "adaptive_placer",
]
