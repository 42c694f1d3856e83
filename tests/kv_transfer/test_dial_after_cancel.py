"""A prefill rank dials a transfer that the decode side has already given up (the request was
cancelled, or its reservation timed out): the dial ends at once, instead of waiting out its
deadline on the decode rank's store, and a dial that does wait never holds up the others that
share that store (under load with cancels this stalled a whole prefill instance for ~30 s)."""

from __future__ import annotations

import threading
import time

import pytest

from kv_transfer.channel import ChannelDialer, ChannelHost
from kv_transfer.errors import KVTransferError, KVTransferTimeout


@pytest.fixture
def sides() -> tuple[ChannelHost, ChannelDialer]:
    host, dialer = ChannelHost(), ChannelDialer()
    yield host, dialer
    dialer.close()
    host.close()


def test_a_dial_for_a_transfer_the_decode_side_gave_up_ends_at_once(
    sides: tuple[ChannelHost, ChannelDialer],
) -> None:
    host, dialer = sides
    host.accept("P.0>D.0", "7", time.monotonic() + 10)
    host.forget_transfer("P.0>D.0", "7")  # the receive ended before the prefill side dialed
    began = time.monotonic()
    with pytest.raises(KVTransferError, match="gave up"):
        dialer.dial(host.endpoint, "P.0>D.0", "7", time.monotonic() + 5)
    assert time.monotonic() - began < 1.0


def test_a_waiting_dial_does_not_hold_the_store_for_other_dials(
    sides: tuple[ChannelHost, ChannelDialer],
) -> None:
    host, dialer = sides
    outcome: list[BaseException] = []

    def wait_for_unaccepted() -> None:
        try:
            dialer.dial(host.endpoint, "P.0>D.0", "8", time.monotonic() + 3)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_unaccepted, daemon=True)
    waiter.start()
    time.sleep(0.3)  # the waiter now waits for transfer 8's key on the shared store
    host.accept("P.0>D.1", "9", time.monotonic() + 10)
    host.forget_transfer("P.0>D.1", "9")
    began = time.monotonic()
    with pytest.raises(KVTransferError):
        dialer.dial(host.endpoint, "P.0>D.1", "9", time.monotonic() + 5)
    assert time.monotonic() - began < 1.0
    assert waiter.is_alive()  # still waiting: its own deadline, nobody else's
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], KVTransferTimeout)
