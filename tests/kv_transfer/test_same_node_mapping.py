"""The same-node transport's handles name one cache each: a cache exported after an earlier
exporter in the same process is gone (its descriptor number reused) maps to its own memory,
never to the earlier one's; and a channel keeps its mapping only for its own life."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.channel import Channel
from kv_transfer.errors import KVTransferError
from kv_transfer.rank_sender import KVRankSender
from kv_transfer.rendezvous import ChannelDialer
from kv_transfer.same_node import export_cache, map_cache

SPEC = KVCacheSpec(2, 6, 4, 2, 8, torch.float32)


def filled(value: float) -> KVCache:
    cache = KVCache(SPEC)
    cache.data.fill_(value)
    return cache


def test_an_export_after_an_earlier_exporter_is_gone_maps_its_own_cache() -> None:
    first = filled(1.0)
    first_handle = export_cache(first)
    first_mapped = map_cache(first_handle)
    assert torch.equal(first_mapped, first.data)
    del first  # a prefill instance of this process shut down; its mapping lives on elsewhere
    gc.collect()

    second = filled(2.0)  # a new prefill instance in the same process: same pid, fd reused
    second_handle = export_cache(second)
    assert second_handle != first_handle
    mapped = map_cache(second_handle)
    assert torch.equal(mapped, second.data)
    second.data[0, 0, 0, 0, 0, 0] = 7.0  # one memory: a write shows through the mapping
    assert mapped[0, 0, 0, 0, 0, 0].item() == 7.0
    assert first_mapped.eq(1.0).all()  # the old mapping still holds the old pages


def test_a_channel_maps_its_source_once_and_drops_it_on_close() -> None:
    cache = filled(3.0)
    channel = Channel("p0-d0", 0, torch.distributed.HashStore(), 0, torch.device("cpu"))
    with pytest.raises(KVTransferError, match="no same-node source"):
        channel.mapped_source()
    channel.use_same_node(export_cache(cache))
    mapped = channel.mapped_source()
    assert channel.mapped_source() is mapped
    assert torch.equal(mapped, cache.data)
    channel.close()
    assert channel._mapped is None


def test_a_rank_that_may_pair_on_its_node_exports_before_it_serves() -> None:
    """On CPU the export moves the cache into shared memory by copying it: done while the model
    writes the cache, it would lose those writes. So it happens when the sending side is built
    (prefill_worker/rank.py passes export_now unless the transport is "network"), not at the
    first same-node dial."""
    early, late = filled(1.0), filled(1.0)
    KVRankSender(early, ChannelDialer(), 0, SPEC.num_kv_heads, export_now=True)
    KVRankSender(late, ChannelDialer(), 0, SPEC.num_kv_heads)
    assert early.data.is_shared()
    assert not late.data.is_shared()
    early.data.fill_(5.0)  # the model's writes after the export land in the shared pages
    assert map_cache(export_cache(early)).eq(5.0).all()


def test_a_handle_whose_descriptor_opens_another_file_is_refused() -> None:
    """Two containers on host networking share a host name and boot id but not /proc/<pid>:
    the pid and descriptor in a handle may name another process's file there. The handle
    carries the file's identity, checked before anything is mapped (and written)."""
    cache = filled(4.0)
    other = filled(5.0)
    handle, other_handle = export_cache(cache), export_cache(other)
    kind, token, (pid, fd, size, _), layout = pickle.loads(handle)
    *_, (_, _, _, other_file), _ = pickle.loads(other_handle)
    forged = pickle.dumps((kind, token, (pid, fd, size, other_file), layout))
    with pytest.raises(KVTransferError, match="not the peer rank's cache"):
        map_cache(forged)
    assert torch.equal(map_cache(handle), cache.data)  # the real one still maps
