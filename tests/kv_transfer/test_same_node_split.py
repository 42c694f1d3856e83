"""The same-node transport's split on CPU (same_node.py): the prefill rank writes the first half
of a transfer's blocks into the decode rank's exported cache itself, after the decode side's ack,
while the decode side copies the rest. Real processes; every byte that lands is checked, for every
prefill/decode TP pair and block layout, and when the prefill side's write window has passed
(it writes nothing and the decode side copies every block)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from kv_transfer.rank_receiver import _SPLIT_WRITE_GRACE_S
from tests.kv_transfer.kv_procs import Worker, free_port, start_workers
from tests.kv_transfer.test_transfer_identity import (
    LAYOUTS,
    check_transfer,
    make_ticket,
    post_transfer,
)

pytestmark = pytest.mark.slow


def split_workers(write_window_s: float) -> tuple[list[Worker], list[Worker]]:
    prefill = start_workers(2, group_port=free_port())
    decode = start_workers(2, group_port=free_port())
    for worker in prefill + decode:
        worker.call("split_mode", 0, write_window_s)  # this suite's blocks are tiny
    return prefill, decode


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[list[Worker], list[Worker]]]:
    prefill, decode = split_workers(30.0)
    try:
        yield prefill, decode
    finally:
        for worker in prefill + decode:
            worker.stop()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_the_prefill_side_writes_half_and_every_byte_lands(
    workers: tuple[list[Worker], list[Worker]], p: int, d: int, layerwise: bool, layout: str
) -> None:
    prefill, decode = workers
    src_block_ids, dst_block_ids = LAYOUTS[layout]
    name = f"split-{p}{d}{int(layerwise)}{layout}"
    ticket = make_ticket(decode, p, d, dst_block_ids, layerwise, name, transport="same_node")
    seed = ticket.transfer_id
    post_transfer(prefill, decode, ticket, 4, seed, src_block_ids)
    check_transfer(prefill, decode, ticket, 4, seed, src_block_ids, len(dst_block_ids) // 2)


def test_past_its_write_window_the_prefill_side_writes_nothing_and_all_lands() -> None:
    prefill, decode = split_workers(0.0)
    try:
        for p, d in ((1, 1), (2, 2)):
            src_block_ids, dst_block_ids = LAYOUTS["scattered"]
            ticket = make_ticket(
                decode, p, d, dst_block_ids, False, f"late-{p}{d}", transport="same_node"
            )
            seed = ticket.transfer_id
            post_transfer(prefill, decode, ticket, 2, seed, src_block_ids)
            check_transfer(prefill, decode, ticket, 2, seed, src_block_ids, 0)
    finally:
        for worker in prefill + decode:
            worker.stop()


def test_one_block_transfers_between_split_ones_keep_the_stream_in_step(
    workers: tuple[list[Worker], list[Worker]],
) -> None:
    """A one-block transfer has no share for the prefill side: no ack, no copy report. One
    channel (the same instance ids) carries them in turn with split transfers."""
    prefill, decode = workers
    for dst_block_ids in ([3], [4, 5, 6], [7], [8, 9], [1]):
        ticket = make_ticket(decode, 1, 1, dst_block_ids, False, "mixed", transport="same_node")
        src_block_ids = [15 - i for i in range(len(dst_block_ids))]
        seed = ticket.transfer_id
        post_transfer(prefill, decode, ticket, 2, seed, src_block_ids)
        check_transfer(prefill, decode, ticket, 2, seed, src_block_ids, len(dst_block_ids) // 2)


def test_a_prefill_side_gone_after_the_ack_keeps_the_blocks_until_its_write_by() -> None:
    """Acked, the prefill side may be writing into the reserved blocks until the write-by the ack
    named (never past its own deadline, copy-by): when its report never comes, the decode side
    ends the transfer only a grace after that, so the blocks cannot go to another request while
    a late write could land. Without the hold it would end at its wait's deadline."""
    prefill, decode = split_workers(30.0)
    try:
        ticket = make_ticket(decode, 1, 1, [4, 5, 6, 7], False, "vanish", transport="same_node")
        ticket = replace(ticket, timeout_s=1.0)  # write-by: the sender's deadline, 1 s on
        decode[0].call("recv", "vanish", ticket, 0, 2)
        sent_at = prefill[0].call("split_then_vanish", "vanish", ticket, 0, 2, [0, 1, 2, 3])
        result = decode[0].call("wait", "vanish", None)
        assert (result["ok"], result["error"]) == (False, "KVTransferTimeout"), result
        held_s = decode[0].call("ended_at", "vanish") - sent_at
        assert held_s >= ticket.timeout_s + _SPLIT_WRITE_GRACE_S - 0.1, (held_s, result)
    finally:
        for worker in prefill + decode:
            worker.stop()
