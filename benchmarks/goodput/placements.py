"""How an adaptive cluster placed one point's requests, from the records' placement fields.

Each record of an adaptive run carries its placement kind ("local": prefill and decode on one
instance; "remote": prefilled on one, KV moved to the other) and how many instances took remote
prefills when the router decided (`prefill_role_instances`). Records of a fixed layout carry
neither, and their breakdown is None. Times are seconds since the point's first send, each
request timed by its send time: the client's nearest reading of when the router placed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planner.metrics import RequestRecord

KINDS = ("local", "remote")


def role_changes(records: Sequence[RequestRecord]) -> list[tuple[float, int]]:
    """(seconds since the first send, prefill_role_instances) at the first request that reports
    it and at every later one, by send time, whose count differs from the one before: the times
    the roles moved."""
    if not records:
        return []
    start = min(r.send_time for r in records)
    changes: list[tuple[float, int]] = []
    for record in sorted(records, key=lambda r: r.send_time):
        count = record.prefill_role_instances
        if count is not None and (not changes or changes[-1][1] != count):
            changes.append((record.send_time - start, count))
    return changes


def placement_breakdown(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Requests placed local and remote (all, and per SLO class in a mix), those with no
    placement (failed before the router placed them), and the role changes; None when no
    record carries a placement (a fixed layout)."""
    placed = [r for r in records if r.placement_kind]
    if not placed:
        return None
    by_class: dict[str, dict[str, int]] = {}
    for record in placed:
        if record.slo_class:
            counts = by_class.setdefault(record.slo_class, dict.fromkeys(KINDS, 0))
            counts[record.placement_kind] = counts.get(record.placement_kind, 0) + 1
    return {
        "num_local": sum(r.placement_kind == "local" for r in placed),
        "num_remote": sum(r.placement_kind == "remote" for r in placed),
        "num_unplaced": len(records) - len(placed),
        "by_class": by_class,
        "role_changes": [list(change) for change in role_changes(records)],
    }
