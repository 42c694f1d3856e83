"""Every socket the runtime opens to listen is on 127.0.0.1: the TP group's rendezvous store (torch's
TCPStore binds every interface by default) and the KV channel host."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
from engine.executor import Executor
from engine.net import create_store
from kv_transfer.rendezvous import ChannelHost
from tests.listening import is_loopback, listening_addresses


def test_store_server_listens_on_loopback_only() -> None:
    store = create_store("127.0.0.1", 0, 1, True, timeout_s=5)
    addresses = listening_addresses([os.getpid()])
    assert f"127.0.0.1:{store.port}" in addresses
    assert all(is_loopback(a) for a in addresses), addresses


@pytest.mark.slow  # starts a TP rank process
def test_tp_executor_and_channel_host_listen_on_loopback_only(tiny_model) -> None:
    config = EngineConfig(
        model_dir=tiny_model("llama"),
        dtype="float64",
        tensor_parallel_size=2,
        num_kv_blocks=8,
    )
    host = ChannelHost("cpu")
    try:
        with Executor(config) as executor:
            pids = [os.getpid(), *executor.worker_pids]
            addresses = listening_addresses(pids)
            assert len(addresses) >= 2  # the TP store, gloo's listeners, the channel store
            assert f"127.0.0.1:{host.endpoint.port}" in addresses
            assert all(is_loopback(a) for a in addresses), addresses
    finally:
        host.close()
