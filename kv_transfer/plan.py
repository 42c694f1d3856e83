"""Re-sharding: which prefill rank sends which KV heads to which decode rank.

Prefill TP=p and decode TP=d may differ. Each side holds heads as `engine.kv_cache.local_kv_heads`
says (split evenly, or replicated when tp_size > num_kv_heads). Every decode rank must receive
exactly its local heads; when a head sits on several prefill ranks, one of them is chosen
deterministically, spreading decode ranks over the replicas so no prefill rank sends everything.

    num_kv_heads=4, p=2, d=4        num_kv_heads=2, p=1, d=4 (replicated on decode)
    prefill 0: h0 h1 -> decode 0, 1  prefill 0: h0 h1 -> decode 0,1 get h0; 2,3 get h1
    prefill 1: h2 h3 -> decode 2, 3
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import local_kv_heads


@dataclass(frozen=True)
class PlanSegment:
    """A run of consecutive KV heads going from one prefill rank to one decode rank.

    `src_head_start` indexes the prefill rank's local heads, `dst_head_start` the decode rank's.
    """

    prefill_rank: int
    decode_rank: int
    num_heads: int
    src_head_start: int
    dst_head_start: int

    @property
    def src_heads(self) -> slice:
        return slice(self.src_head_start, self.src_head_start + self.num_heads)

    @property
    def dst_heads(self) -> slice:
        return slice(self.dst_head_start, self.dst_head_start + self.num_heads)


@dataclass(frozen=True)
class TransferPlan:
    num_kv_heads: int
    prefill_tp_size: int
    decode_tp_size: int
    segments: tuple[PlanSegment, ...]

    def for_prefill_rank(self, prefill_rank: int) -> list[PlanSegment]:
        return [s for s in self.segments if s.prefill_rank == prefill_rank]

    def for_decode_rank(self, decode_rank: int) -> list[PlanSegment]:
        return [s for s in self.segments if s.decode_rank == decode_rank]


def plan_transfer(num_kv_heads: int, prefill_tp_size: int, decode_tp_size: int) -> TransferPlan:
    """The segments that carry every decode rank's heads; raises ValueError if a TP size does not
    fit the heads (the same rule the model's sharding applies)."""
    prefill_heads = [
        local_kv_heads(num_kv_heads, prefill_tp_size, r) for r in range(prefill_tp_size)
    ]
    segments: list[PlanSegment] = []
    for decode_rank in range(decode_tp_size):
        dst_heads = local_kv_heads(num_kv_heads, decode_tp_size, decode_rank)
        for dst_index, head in enumerate(dst_heads):
            holders = [r for r, heads in enumerate(prefill_heads) if head in heads]
            # Replicas: decode rank k takes replica k mod n, so the load spreads evenly.
            sender = holders[decode_rank % len(holders)]
            src_index = head - prefill_heads[sender].start
            last = segments[-1] if segments else None
            if (
                last is not None
                and last.decode_rank == decode_rank
                and last.prefill_rank == sender
                and last.src_head_start + last.num_heads == src_index
                and last.dst_head_start + last.num_heads == dst_index
            ):
                segments[-1] = PlanSegment(
                    sender,
                    decode_rank,
                    last.num_heads + 1,
                    last.src_head_start,
                    last.dst_head_start,
                )
            else:
                segments.append(PlanSegment(sender, decode_rank, 1, src_index, dst_index))
    pairs = [(s.prefill_rank, s.decode_rank) for s in segments]
    # Heads are contiguous on both sides, so one pair never needs two segments; the wire relies
    # on it (one set of messages per channel per transfer).
    assert len(set(pairs)) == len(pairs), f"two segments for one rank pair: {segments}"
    return TransferPlan(num_kv_heads, prefill_tp_size, decode_tp_size, tuple(segments))
