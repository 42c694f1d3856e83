"""The same-node transport on one GPU: a prefill and a decode process share cuda:0; the decode
rank maps the prefill rank's cache through CUDA IPC and copies the blocks device to device. The
blocks land byte-identical and nothing else in the cache changes. The exporting process lives
until the importer has checked the blocks (it maps that process's memory). Skipped without
CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.multiprocessing as mp

from kv_transfer.messages import KVTicket
from tests.kv_transfer.test_nccl_transfer import (
    DST_IDS,
    SPEC,
    TIMEOUT_S,
    _decode_main,
    _prefill_main,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

_transfer_ids = itertools.count(1)


@pytest.mark.parametrize("layerwise", [False, True])
def test_same_node_transfer_on_one_gpu_is_byte_identical(layerwise: bool) -> None:
    assert torch.cuda.is_available()
    context = mp.get_context("spawn")
    from_decode, to_decode, from_prefill = context.Queue(), context.Queue(), context.Queue()
    release = context.Queue()  # the exporter outlives the importer's copy
    decode = context.Process(target=_decode_main, args=("cuda:0", from_decode, to_decode))
    decode.start()
    prefill = None
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
            transport="same_node",
        )
        to_decode.put(ticket)
        assert from_decode.get(timeout=TIMEOUT_S) == "posted"
        prefill = context.Process(
            target=_prefill_main, args=("cuda:0", ticket, from_prefill, release)
        )
        prefill.start()
        assert from_prefill.get(timeout=TIMEOUT_S) == "sent"
        assert from_decode.get(timeout=TIMEOUT_S) == (4242, True, True)
    finally:
        release.put("done")
        for process in (decode, prefill):
            if process is not None:
                process.join(10)
                if process.is_alive():
                    process.kill()
