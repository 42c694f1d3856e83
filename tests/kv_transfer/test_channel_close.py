"""A channel closed while its connect waits for the peer: the group that comes up afterwards is
aborted at once, never left running on a channel nobody can close again. Real processes, gloo."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from engine.net import create_store
from kv_transfer.channel import Channel
from kv_transfer.errors import KVTransferError

pytestmark = pytest.mark.slow

PAIR = "P.0>D.0"


def _late_peer(port: int, go: Any, done: Any) -> None:
    """Join the pair's group once told to (rank 1), then report whether it came up."""
    store = create_store("127.0.0.1", port, None, False, 30.0)
    if not go.wait(30.0):
        done.put("never told to connect")
        return
    try:
        Channel(PAIR, 1, store, 1, torch.device("cpu")).connect(time.monotonic() + 30.0)
        done.put("connected")
    except KVTransferError as exc:
        done.put(f"failed: {exc}")


def test_a_group_that_comes_up_after_close_is_aborted() -> None:
    store = create_store("127.0.0.1", 0, None, True, 30.0, wait_for_workers=False)
    context = torch.multiprocessing.get_context("spawn")
    go, done = context.Event(), context.Queue()
    peer = context.Process(target=_late_peer, args=(store.port, go, done), daemon=True)
    peer.start()
    channel = Channel(PAIR, 1, store, 0, torch.device("cpu"))
    errors: list[Exception] = []

    def connect() -> None:
        try:
            channel.connect(time.monotonic() + 30.0)
        except KVTransferError as exc:
            errors.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    try:
        thread.start()
        time.sleep(0.5)  # the connect is now waiting for its peer
        channel.close()
        go.set()  # the peer joins: the rendezvous completes after the close
        assert done.get(timeout=60.0) == "connected"
        thread.join(30.0)
        assert not thread.is_alive()
        assert errors, "a connect that ended after close() must fail"
        assert channel._group is None and channel.broken
    finally:
        peer.join(10.0)
        if peer.is_alive():
            peer.kill()
