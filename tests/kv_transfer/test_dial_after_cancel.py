"""A prefill rank dials a transfer whose receive has already ended on the decode side (the request
was cancelled, or its reservation timed out): the dial fails at once, instead of waiting out its
deadline on the decode rank's store; such a wait held the store client every send of the prefill
rank to that decode rank shares, and under load with cancels stalled a whole prefill instance for
~30 s at a time."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.rendezvous import ChannelDialer, ChannelHost


@pytest.fixture
def sides() -> Iterator[tuple[ChannelHost, ChannelDialer]]:
    host, dialer = ChannelHost(), ChannelDialer()
    yield host, dialer
    dialer.close()
    host.close()


def test_a_dial_for_a_receive_that_ended_fails_at_once(
    sides: tuple[ChannelHost, ChannelDialer],
) -> None:
    host, dialer = sides
    host.accept("P.0>D.0", "7", time.monotonic() + 10)
    host.forget_transfer("P.0>D.0", "7")  # the receive ended before the prefill side dialed
    began = time.monotonic()
    with pytest.raises(KVTransferError, match="no longer expects transfer 7"):
        dialer.dial(host.endpoint, "P.0>D.0", "7", time.monotonic() + 5)
    assert time.monotonic() - began < 1.0


def test_dials_after_a_failed_one_still_reach_the_store_at_once(
    sides: tuple[ChannelHost, ChannelDialer],
) -> None:
    host, dialer = sides
    for transfer in ("8", "9", "10"):  # never accepted, or accepted and over: each fails fast
        if transfer != "8":
            host.accept("P.0>D.1", transfer, time.monotonic() + 10)
            host.forget_transfer("P.0>D.1", transfer)
        began = time.monotonic()
        with pytest.raises(KVTransferError):
            dialer.dial(host.endpoint, "P.0>D.1", transfer, time.monotonic() + 5)
        assert time.monotonic() - began < 1.0
