"""A broken channel leaves nothing waiting: what the decode side expected ends at once with an
error, not at its deadline, and its reader (parked on the header receive that waits for new work)
ends once the prefill side drops its end too, as it does when it learns of the break. (Gloo cannot
wake a posted receive from its own side: not abort, shutdown or dropping the group does; only
the peer's closing the connection.) Real gloo groups, both ends in this process. And the NCCL
settings a KV channel needs win over a user's that would end the process."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kv_transfer import channel as channel_module
from kv_transfer.channel import Channel
from kv_transfer.errors import KVTransferError
from kv_transfer.streams import Incoming


class _Expected(Incoming):
    def __init__(self) -> None:
        self.transfer_id = 1
        self.deadline = time.monotonic() + 600.0
        self.ended = threading.Event()
        self.error: KVTransferError | None = None

    def receive(
        self, channel: Channel, header: torch.Tensor, post_next: Callable[[], None]
    ) -> object:
        raise AssertionError("no header is ever sent")

    def end(self, result: object, error: KVTransferError | None) -> None:
        self.error = error
        self.ended.set()


def _connected_pair() -> tuple[Channel, Channel]:
    store = torch.distributed.HashStore()
    decode = Channel("P.0>D.0", 0, store, 0, torch.device("cpu"))
    prefill = Channel("P.0>D.0", 0, store, 1, torch.device("cpu"))
    deadline = time.monotonic() + 30.0
    joiner = threading.Thread(target=prefill.connect, args=(deadline,))
    joiner.start()
    decode.connect(deadline)
    joiner.join(30.0)
    return decode, prefill


def test_a_broken_channel_ends_what_it_expected_and_its_reader() -> None:
    decode, prefill = _connected_pair()
    expected = _Expected()
    decode.receives.expect(expected)
    reader = decode.receives._reader
    assert reader is not None and reader.is_alive()
    time.sleep(0.2)  # the header receive is posted
    decode.mark_broken()
    assert expected.ended.wait(5.0) and expected.error is not None
    later = _Expected()
    decode.receives.expect(later)  # nothing more is accepted on a broken channel
    assert later.ended.is_set() and later.error is not None
    prefill.mark_broken()  # the prefill side learns of the break and drops its group
    reader.join(10.0)
    assert not reader.is_alive(), "the reader outlived both ends of its channel"


@pytest.mark.parametrize("user_value", [None, "1", "3"])
def test_nccl_error_handling_never_tears_the_process_down(
    monkeypatch: pytest.MonkeyPatch, user_value: str | None
) -> None:
    if user_value is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user_value)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    channel_module._nccl_raises_instead_of_killing()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: raise, live on
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"
