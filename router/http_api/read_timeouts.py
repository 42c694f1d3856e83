"""uvicorn's h11 protocol with read timeouts: a client that stops mid-request is disconnected.

    header timeout   from the connection (or a keep-alive request's first byte) to the end of
                     the request head, in all: trickling a byte at a time does not extend it
    body timeout     the longest pause between two reads of a body the app is waiting for

These are nginx's `client_header_timeout` and `client_body_timeout`. uvicorn has neither (its
keep-alive timer stops at a request's first byte), so without them a client that sends half a
request holds its socket for ever. A pause while uvicorn has stopped reading (the app has not
taken the body yet) is the server's, not the client's, and does not count. On a timeout the
connection is closed: the app, if it was reading, sees the client gone. The protocol also sets
TCP_NODELAY on its socket (see `_no_delay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these timeouts, for uvicorn.Config(http=...)."""

    class TimedH11Protocol(_TimedH11Protocol):
        pass

    TimedH11Protocol.header_timeout_s = header_timeout_s
    TimedH11Protocol.body_timeout_s = body_timeout_s
    return TimedH11Protocol


class _TimedH11Protocol(H11Protocol):
    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading_head = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms the keep-alive timer for the idle time to come
        self._cancel_read_timer()
        self._reading_head = False
        self._follow_state()

    def _follow_state(self) -> None:
        """Arm the timer that fits what the connection waits for from the client now."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if not self._reading_head and self.conn.trailing_data[0]:  # a request has begun
                self._arm_head_timer()
        elif state is h11.SEND_BODY:
            self._reading_head = False
            self._arm(self.body_timeout_s)  # from this read on
        else:
            self._reading_head = False
            self._cancel_read_timer()

    def _arm_head_timer(self) -> None:
        self._reading_head = True
        self._arm(self.header_timeout_s)

    def _arm(self, timeout_s: float) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out, timeout_s)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self, timeout_s: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY and self.flow.read_paused:
            self._arm(timeout_s)  # uvicorn waits for the app, not for the client
            return
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.IDLE and not self._reading_head:
            return  # between requests: the keep-alive timer's business
        self.transport.close()


def _no_delay(transport: asyncio.Transport) -> None:
    """Turn Nagle's algorithm off: uvicorn writes a response's head and body apart, and the
    body would wait for the client's delayed ACK of the head (40 ms on Linux) on every request
    but a connection's first. asyncio sets this only on sockets made with IPPROTO_TCP, and
    `socket.create_server` makes them with protocol 0."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
