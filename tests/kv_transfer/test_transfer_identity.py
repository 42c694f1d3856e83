"""Real processes over gloo: the KV that lands is byte-identical to the source blocks, for every
prefill/decode TP pair, both wire modes, split and replicated heads, and block ids that are one
run on both sides (sent and received in place), a few runs, or scattered (gathered and
scattered)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.messages import KVTicket
from kv_transfer.staging import StagingPool
from kv_transfer.wire import MAX_PIECES, WireView, run_lengths
from tests.kv_transfer.kv_procs import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_LAYERS,
    Worker,
    free_port,
    rank_spec,
    start_workers,
)

pytestmark = pytest.mark.slow

_transfer_ids = itertools.count(1)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[list[Worker], list[Worker]]]:
    """Two prefill ranks and two decode ranks; each pair of processes also has a default group."""
    prefill = start_workers(2, group_port=free_port())
    decode = start_workers(2, group_port=free_port())
    try:
        yield prefill, decode
    finally:
        for worker in prefill + decode:
            worker.stop()


def make_ticket(
    decode: list[Worker],
    p: int,
    d: int,
    dst_block_ids: list[int],
    layerwise: bool,
    name: str,
    min_piece_bytes: int = 0,  # pieces and per-head messages of any size: these blocks are tiny
    transport: str = "network",
) -> KVTicket:
    endpoints = tuple(worker.call("endpoint") for worker in decode[:d])
    return KVTicket(
        request_id=name,
        transfer_id=next(_transfer_ids),
        block_ids=tuple(dst_block_ids),
        num_tokens=4 * len(dst_block_ids) - 1,
        prefill_instance_id=f"P{p}-{name}",
        prefill_tp_size=p,
        decode_instance_id=f"D{d}-{name}",
        decode_tp_size=d,
        decode_endpoints=endpoints,
        layerwise=layerwise,
        timeout_s=20.0,
        min_piece_bytes=min_piece_bytes,
        transport=transport,
    )


def post_transfer(
    prefill: list[Worker],
    decode: list[Worker],
    ticket: KVTicket,
    num_kv_heads: int,
    seed: int,
    src_block_ids: list[int],
) -> None:
    """Post the receives first, then the sends: what a decode worker does on issuing a ticket."""
    name = ticket.request_id
    for rank in range(ticket.decode_tp_size):
        decode[rank].call("recv", name, ticket, rank, num_kv_heads)
    # Prefill ranks run in parallel, as TP ranks do: post to all, then collect.
    for rank in range(ticket.prefill_tp_size):
        prefill[rank].commands.put(
            ("send", name, ticket, rank, num_kv_heads, seed, src_block_ids, 1000 + seed, None)
        )
    for rank in range(ticket.prefill_tp_size):
        prefill[rank].reply()


def check_transfer(
    prefill: list[Worker],
    decode: list[Worker],
    ticket: KVTicket,
    num_kv_heads: int,
    seed: int,
    src_block_ids: list[int],
    written: int = 0,
) -> None:
    """`written`: how many blocks each prefill lane wrote into the decode cache itself."""
    name = ticket.request_id
    for rank in range(ticket.prefill_tp_size):
        result = prefill[rank].call("wait", name, None)
        assert result["ok"] is True and set(result["written"]) <= {written}, result
    for rank in range(ticket.decode_tp_size):
        check = (
            seed,
            num_kv_heads,
            ticket.decode_tp_size,
            rank,
            src_block_ids,
            list(ticket.block_ids),
        )
        result = decode[rank].call("wait", name, check)
        stamped_s_ago = result.pop("stamped_s_ago")
        assert result == {"ok": True, "first_token_id": 1000 + seed, "mismatch": None}
        assert stamped_s_ago is not None and 0 <= stamped_s_ago < 60  # the first token's time


LAYOUTS = {  # (source ids, destination ids)
    "contiguous": ([2, 3, 4, 5], [10, 11, 12, 13]),
    # a cached prefix run, then new blocks; the destination is two runs (two pieces)
    "runs": ([7, 8, 1, 2, 3], [10, 11, 12, 4, 5]),
    "scattered": ([9, 1, 14, 6, 0, 11, 3, 15, 7], [3, 15, 0, 8, 12, 5, 10, 1, 13]),
}


@pytest.mark.parametrize("transport", ["network", "auto"])  # auto: same node here
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["2heads", "1head"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_received_kv_is_byte_identical(
    workers: tuple[list[Worker], list[Worker]],
    p: int,
    d: int,
    num_kv_heads: int,
    layerwise: bool,
    layout: str,
    transport: str,
) -> None:
    prefill, decode = workers
    src_block_ids, dst_block_ids = LAYOUTS[layout]
    name = f"req-{p}{d}{num_kv_heads}{int(layerwise)}{layout}{transport}"
    ticket = make_ticket(decode, p, d, dst_block_ids, layerwise, name, transport=transport)
    seed = ticket.transfer_id
    post_transfer(prefill, decode, ticket, num_kv_heads, seed, src_block_ids)
    check_transfer(prefill, decode, ticket, num_kv_heads, seed, src_block_ids)
    kinds = [kind for rank in range(p) for kind in prefill[rank].call("same_node", name)]
    assert kinds and set(kinds) == {transport == "auto"}


@pytest.mark.parametrize("layout", ["contiguous", "runs"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_heads_grouped_per_layer_are_byte_identical(
    workers: tuple[list[Worker], list[Worker]], p: int, d: int, layout: str
) -> None:
    """Per-head messages smaller than the ticket's min_piece_bytes: one message per (layer, k/v)
    with all the channel's heads, gathered and scattered."""
    prefill, decode = workers
    src_block_ids, dst_block_ids = LAYOUTS[layout]
    name = f"grouped-{p}{d}{layout}"
    ticket = make_ticket(decode, p, d, dst_block_ids, True, name, min_piece_bytes=1 << 30)
    seed = ticket.transfer_id
    post_transfer(prefill, decode, ticket, 4, seed, src_block_ids)
    check_transfer(prefill, decode, ticket, 4, seed, src_block_ids)


def test_two_to_one_and_one_to_two_at_the_same_time(
    workers: tuple[list[Worker], list[Worker]],
) -> None:
    prefill, decode = workers
    two_to_one = make_ticket(decode, 2, 1, [0, 5, 7], True, "p2d1")
    # The 1 -> 2 instance's single prefill rank is the second prefill process, and its decode
    # ranks are the decode processes in reverse order, so every process serves both transfers.
    one_to_two = make_ticket(decode[::-1], 1, 2, [4, 1, 2], False, "p1d2")
    post_transfer(prefill, decode, two_to_one, 2, 11, [1, 2, 3])
    post_transfer(prefill[::-1], decode[::-1], one_to_two, 2, 12, [8, 9, 10])
    check_transfer(prefill, decode, two_to_one, 2, 11, [1, 2, 3])
    check_transfer(prefill[::-1], decode[::-1], one_to_two, 2, 12, [8, 9, 10])


def test_channels_coexist_with_the_default_group(
    workers: tuple[list[Worker], list[Worker]],
) -> None:
    """Each worker's own TP group (the default group) still works around the pair channels."""
    prefill, decode = workers
    for group in (prefill, decode):
        for rank, worker in enumerate(group):
            worker.commands.put(("all_reduce", rank + 1))
        assert [worker.reply() for worker in group] == [3.0, 3.0]
    ticket = make_ticket(decode, 2, 2, [6, 7], True, "coexist")
    post_transfer(prefill, decode, ticket, 2, 5, [0, 1])
    check_transfer(prefill, decode, ticket, 2, 5, [0, 1])
    for group in (prefill, decode):
        for rank, worker in enumerate(group):
            worker.commands.put(("all_reduce", 10 * rank))
        assert [worker.reply() for worker in group] == [10.0, 10.0]


def test_layerwise_messages_follow_the_decode_runs() -> None:
    """Both sides split a layerwise transfer at the decode side's runs (the ticket's ids): the
    decode side then receives every message in place, the prefill side gathers only the pieces
    that are not runs of its own blocks. Past MAX_PIECES runs, or with pieces under the ticket's
    min_piece_bytes, or in whole mode, there is one piece."""
    cache, staging, heads = KVCache(rank_spec(2, 1, 0)), StagingPool(), slice(0, 2)

    def ticket(dst: list[int], layerwise: bool = True, min_piece_bytes: int = 0) -> KVTicket:
        return KVTicket(
            "r",
            1,
            tuple(dst),
            4 * len(dst),
            "P",
            1,
            "D",
            1,
            (),
            layerwise,
            1.0,
            min_piece_bytes=min_piece_bytes,
        )

    src, dst = LAYOUTS["runs"]
    sender = WireView.for_ticket(cache, src, heads, ticket(dst))
    receiver = WireView.for_ticket(cache, dst, heads, ticket(dst))
    assert run_lengths(dst) == sender.pieces == receiver.pieces == (3, 2)
    assert sender.num_payload_messages == receiver.num_payload_messages == NUM_LAYERS * 2 * 2 * 2
    staged_out = [sender.outgoing(i, staging)[1] for i in range(sender.num_payload_messages)]
    staged_in = [receiver.incoming(i, staging)[1] for i in range(receiver.num_payload_messages)]
    assert staged_out == [True, False] * (NUM_LAYERS * 2 * 2)  # piece 0 of src is 7, 8, 1
    assert not any(staged_in)
    block_bytes = BLOCK_SIZE * HEAD_DIM * 4  # one head of one block, float32
    small = ticket(dst, min_piece_bytes=2 * block_bytes + 1)  # the 2-block piece is too small
    assert WireView.for_ticket(cache, dst, heads, small).pieces is None
    assert WireView.for_ticket(cache, src, heads, ticket(dst, layerwise=False)).pieces is None
    scattered_src, scattered_dst = LAYOUTS["scattered"]
    assert len(run_lengths(scattered_dst)) > MAX_PIECES
    one_piece = WireView.for_ticket(cache, scattered_src, heads, ticket(scattered_dst))
    assert one_piece.pieces is None and not one_piece.grouped
    # A message per head under min_piece_bytes: the heads of a (layer, k/v) go together.
    tiny = WireView.for_ticket(cache, src, heads, ticket(dst, min_piece_bytes=1 << 20))
    assert tiny.grouped and tiny.pieces is None and tiny.num_payload_messages == NUM_LAYERS * 2
    assert all(tiny.outgoing(i, staging)[1] for i in range(tiny.num_payload_messages))


def test_many_layers_times_many_heads_group_the_heads_instead_of_failing() -> None:
    """60 layers x 52 KV heads on one rank (a 30B multi-head model at TP=1) would need 6,242
    messages per channel, more than a transfer's tag window: its heads travel grouped."""
    spec = KVCacheSpec(60, 4, BLOCK_SIZE, 52, HEAD_DIM, torch.float32)
    ticket = KVTicket("r", 1, (0, 1, 2, 3), 16, "P", 1, "D", 1, (), True, 1.0, min_piece_bytes=0)
    view = WireView.for_ticket(KVCache(spec), [0, 1, 2, 3], slice(0, 52), ticket)
    assert view.grouped and view.num_payload_messages == 60 * 2
