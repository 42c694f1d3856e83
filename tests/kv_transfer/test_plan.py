"""The re-sharding plan, checked exhaustively for small head counts and TP sizes."""

from __future__ import annotations

import itertools

import pytest

from engine.kv_cache import local_kv_heads
from kv_transfer.plan import PlanSegment, plan_transfer


def valid_tp_sizes(num_kv_heads: int) -> list[int]:
    return [t for t in range(1, 9) if num_kv_heads % t == 0 or t % num_kv_heads == 0]


CASES = [
    (h, p, d)
    for h in range(1, 9)
    for p, d in itertools.product(valid_tp_sizes(h), valid_tp_sizes(h))
]


@pytest.mark.parametrize("num_kv_heads,p,d", CASES)
def test_every_decode_rank_gets_exactly_its_heads_from_a_holder(
    num_kv_heads: int, p: int, d: int
) -> None:
    plan = plan_transfer(num_kv_heads, p, d)
    for decode_rank in range(d):
        wanted = local_kv_heads(num_kv_heads, d, decode_rank)
        received: list[int] = []
        for segment in plan.for_decode_rank(decode_rank):
            held = local_kv_heads(num_kv_heads, p, segment.prefill_rank)
            src = list(held)[segment.src_heads]
            dst = list(wanted)[segment.dst_heads]
            assert len(src) == len(dst) == segment.num_heads  # slices stay inside both sides
            assert src == dst  # the same global heads leave and land
            received += dst
        assert sorted(received) == list(wanted)
    pairs = [(s.prefill_rank, s.decode_rank) for s in plan.segments]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("num_kv_heads,p,d", [c for c in CASES if c[1] > c[0] and c[2] >= c[1]])
def test_replicated_heads_spread_over_every_replica(num_kv_heads: int, p: int, d: int) -> None:
    """With heads replicated on the prefill side and enough decode ranks, every prefill rank
    sends, and no prefill rank sends more than its fair share rounded up."""
    plan = plan_transfer(num_kv_heads, p, d)
    loads = [sum(s.num_heads for s in plan.for_prefill_rank(r)) for r in range(p)]
    assert min(loads) >= 1
    assert max(loads) <= -(-d // p) * max(1, num_kv_heads // d)


def test_known_plans() -> None:
    assert plan_transfer(2, 1, 1).segments == (PlanSegment(0, 0, 2, 0, 0),)
    assert plan_transfer(2, 2, 1).segments == (
        PlanSegment(0, 0, 1, 0, 0),
        PlanSegment(1, 0, 1, 0, 1),
    )
    assert plan_transfer(2, 1, 2).segments == (
        PlanSegment(0, 0, 1, 0, 0),
        PlanSegment(0, 1, 1, 1, 0),
    )
    # one head replicated on both sides: each decode rank takes its own replica
    assert plan_transfer(1, 2, 2).segments == (
        PlanSegment(0, 0, 1, 0, 0),
        PlanSegment(1, 1, 1, 0, 0),
    )


def test_tp_sizes_the_heads_do_not_allow_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide"):
        plan_transfer(4, 3, 1)
    with pytest.raises(ValueError, match="must divide"):
        plan_transfer(2, 1, 3)
