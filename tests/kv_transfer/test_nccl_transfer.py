"""The KV hand-off over NCCL: a prefill rank on cuda:0 sends a request's blocks to a decode rank on
cuda:1 through the same channel code gloo uses on CPU; the blocks land byte-identical.

Needs two CUDA devices (NCCL takes one GPU per rank); skips otherwise.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.messages import KVTicket

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (NCCL takes one GPU per rank)",
    ),
]

SPEC = KVCacheSpec(
    num_layers=4, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
)
SRC_IDS, DST_IDS = [3, 4, 5, 9, 1], [20, 21, 22, 23, 7]  # one run + a stray block on each side
TIMEOUT_S = 60.0


def _source(device: str) -> KVCache:
    cache = KVCache(SPEC, device)
    generator = torch.Generator().manual_seed(0)
    cache.data.copy_(torch.randn(SPEC.shape, generator=generator).to(SPEC.dtype))
    return cache


def _decode_main(device: str, to_parent: Any, from_parent: Any) -> None:
    from kv_transfer.rank_receiver import KVRankReceiver
    from kv_transfer.rendezvous import ChannelHost

    host = ChannelHost(device)
    to_parent.put(host.endpoint)
    ticket = from_parent.get(timeout=TIMEOUT_S)
    cache = KVCache(SPEC, device)
    handle = KVRankReceiver(cache, host, 0, SPEC.num_kv_heads).receive(ticket)
    to_parent.put("posted")
    received = handle.wait(TIMEOUT_S)
    expected = _source("cpu").data[:, :, :, SRC_IDS]
    landed = cache.data[:, :, :, DST_IDS].cpu()
    untouched = [b for b in range(SPEC.num_blocks) if b not in DST_IDS]
    to_parent.put(
        (
            received.first_token_id,
            torch.equal(landed.view(torch.int16), expected.view(torch.int16)),
            bool((cache.data[:, :, :, untouched] == 0).all()),
        )
    )


def _prefill_main(device: str, ticket: KVTicket, to_parent: Any, release: Any = None) -> None:
    """Send the source blocks; with `release`, keep the cache alive until the parent says the
    decode side is done with it (a same-node importer maps this process's memory)."""
    from kv_transfer.rank_sender import KVRankSender
    from kv_transfer.rendezvous import ChannelDialer

    cache = _source(device)
    handle = KVRankSender(cache, ChannelDialer(device), 0, SPEC.num_kv_heads).start(ticket, SRC_IDS)
    if ticket.layerwise:
        for layer in range(SPEC.num_layers):
            handle.send_layer(layer)
    handle.finish(4242)
    handle.wait(TIMEOUT_S)
    to_parent.put("sent")
    if release is not None:
        release.get(timeout=TIMEOUT_S)


_transfer_ids = itertools.count(1)


@pytest.mark.parametrize("layerwise", [False, True])
def test_nccl_transfer_is_byte_identical(layerwise: bool) -> None:
    context = mp.get_context("spawn")
    from_decode, to_decode, from_prefill = context.Queue(), context.Queue(), context.Queue()
    decode = context.Process(target=_decode_main, args=("cuda:1", from_decode, to_decode))
    decode.start()
    try:
        endpoint = from_decode.get(timeout=TIMEOUT_S)
        ticket = KVTicket(
            request_id="r",
            transfer_id=next(_transfer_ids),
            block_ids=tuple(DST_IDS),
            num_tokens=SPEC.block_size * len(DST_IDS) - 3,
            prefill_instance_id="P",
            prefill_tp_size=1,
            decode_instance_id="D",
            decode_tp_size=1,
            decode_endpoints=(endpoint,),
            layerwise=layerwise,
            timeout_s=TIMEOUT_S,
            min_piece_bytes=0,
        )
        to_decode.put(ticket)
        assert from_decode.get(timeout=TIMEOUT_S) == "posted"
        prefill = context.Process(target=_prefill_main, args=("cuda:0", ticket, from_prefill))
        prefill.start()
        assert from_prefill.get(timeout=TIMEOUT_S) == "sent"
        assert from_decode.get(timeout=TIMEOUT_S) == (4242, True, True)
        prefill.join(TIMEOUT_S)
    finally:
        for process in (decode, locals().get("prefill")):
            if process is not None and process.is_alive():
                process.kill()
