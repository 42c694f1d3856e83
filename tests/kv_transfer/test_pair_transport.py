"""Which transport a prefill-decode rank pair takes, given the nodes and the GPUs each sees.

A node whose runtime gives every worker only its own GPU (CUDA_VISIBLE_DEVICES per worker, a Ray
actor with one GPU) must hand KV off over the network: the decode rank cannot map a GPU it does
not see. These cases are decided from UUIDs alone, so CPU shows them."""

from __future__ import annotations

import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.same_node import pair_transport

NODE, OTHER = "host/boot/pidns", "other/boot/pidns"
GPU0, GPU1 = "GPU-aaaa", "GPU-bbbb"


@pytest.mark.parametrize(
    ("transport", "decode_node", "decode_gpus", "source_gpu", "expected"),
    [
        ("auto", NODE, (), None, "same_node"),  # CPU caches on one node: shared memory
        ("auto", OTHER, (), None, "network"),
        ("auto", NODE, (GPU1,), GPU0, "network"),  # one GPU per worker: unmappable peer
        ("auto", NODE, (GPU0, GPU1), GPU0, "same_node"),  # the node's GPUs visible: CUDA IPC
        ("auto", NODE, (GPU0,), GPU0, "same_node"),  # one GPU shared by both processes
        ("auto", OTHER, (GPU0,), GPU0, "network"),  # same UUID string, another machine
        ("network", NODE, (GPU0,), GPU0, "network"),
        ("same_node", NODE, (GPU0, GPU1), GPU1, "same_node"),
    ],
)
def test_the_pair_maps_the_peer_only_when_it_can(
    transport: str,
    decode_node: str,
    decode_gpus: tuple[str, ...],
    source_gpu: str | None,
    expected: str,
) -> None:
    chosen = pair_transport(transport, decode_node, decode_gpus, source_gpu, local_node_id=NODE)
    assert chosen == expected


def test_forced_same_node_with_an_unmappable_peer_says_what_to_set() -> None:
    with pytest.raises(KVTransferError, match="cannot see GPU GPU-aaaa.*transport auto or network"):
        pair_transport("same_node", NODE, (GPU1,), GPU0, local_node_id=NODE)
