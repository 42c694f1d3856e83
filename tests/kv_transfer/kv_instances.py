"""One-rank prefill and decode instances for the failure tests: pool + state machine + rank data
path, wired the way the workers wire them. The test process is the control plane: it relays the
returned messages between the two processes."""

from __future__ import annotations

import time
from typing import Any

from engine.block_pool import BlockPool
from engine.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import KVTransferError
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone
from kv_transfer.rank_receiver import KVRankReceiver, RecvHandle
from kv_transfer.rank_sender import KVRankSender, SendHandle
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.kv_transfer.kv_procs import NUM_LAYERS, ChannelHost, _WorkerState, rank_spec


class InstanceState(_WorkerState):
    """Commands the failure tests send to a worker process (see kv_procs._worker_main)."""

    # ------------------------------------------------------------------ decode
    def decode_setup(
        self,
        num_kv_heads: int,
        head_dim: int,
        timeout_s: float,
        layerwise: bool = True,
        transport: str = "network",
    ) -> Any:
        self.host = self.host or ChannelHost()
        spec = rank_spec(num_kv_heads, 1, 0, head_dim)
        self.decode_pool = BlockPool(spec.num_blocks)
        config = KVTransferConfig(
            transfer_timeout_s=timeout_s, layerwise=layerwise, transport=transport
        )
        self.receiver = KVReceiver(
            self.decode_pool, spec.block_size, "D", [self.host.endpoint], config
        )
        self.rank_receiver = KVRankReceiver(KVCache(spec), self.host, 0, num_kv_heads)
        self.recvs: dict[str, tuple[RecvHandle, float]] = {}
        return self.host.endpoint

    def decode_reserve(self, request: KVReserveRequest) -> KVTicket | KVRefusal:
        answer = self.receiver.reserve(request)
        if isinstance(answer, KVTicket):  # post the receive at once, as the decode worker does
            self.recvs[answer.request_id] = (self.rank_receiver.receive(answer), time.monotonic())
        return answer

    def decode_wait(self, request_id: str) -> dict[str, Any]:
        handle, started = self.recvs.pop(request_id)
        error = None
        try:
            handle.wait(60.0)
        except KVTransferError as exc:
            error = exc
        ack = self.receiver.on_rank_finished(request_id, 0, None if error is None else str(error))
        if ack is not None and ack.success:
            self.decode_pool.free_sequence_blocks(self.receiver.claim(request_id).block_ids)
        return {
            "error": type(error).__name__ if error else None,
            "elapsed_s": time.monotonic() - started,
            "ack": ack,
            "num_free_blocks": self.decode_pool.num_free_blocks,
        }

    def decode_abort(self, request_id: str) -> KVAbort | None:
        return self.receiver.abort(request_id, "the client cancelled")

    def decode_num_free_blocks(self) -> int:
        return self.decode_pool.num_free_blocks

    def decode_on_abort(self, message: KVAbort) -> int:
        self.receiver.on_abort(message)
        return self.decode_pool.num_free_blocks

    # ----------------------------------------------------------------- prefill
    def prefill_setup(self, num_kv_heads: int, head_dim: int) -> None:
        spec = rank_spec(num_kv_heads, 1, 0, head_dim)
        cache = KVCache(spec)
        cache.data.fill_(1.5)
        self.prefill_pool = BlockPool(spec.num_blocks)
        self.released: list[tuple[str, bool]] = []
        self.sender = KVSender(self.prefill_pool, 1, lambda r, ok: self.released.append((r, ok)))
        self.rank_sender = KVRankSender(cache, self.dialer, 0, num_kv_heads)
        self.sends: dict[str, tuple[SendHandle, float]] = {}

    def prefill_start(self, ticket: KVTicket, num_layers_to_send: int | None) -> None:
        """Start a transfer; with num_layers_to_send set, stop after that many layers (mid-way)."""
        block_ids = self.prefill_pool.allocate(len(ticket.block_ids))
        self.sender.start(ticket, block_ids)
        self.prefill_pool.free_sequence_blocks(block_ids)  # the scheduler lets go at once
        handle = self.rank_sender.start(ticket, block_ids)
        self.sends[ticket.request_id] = (handle, time.monotonic())
        for layer in range(NUM_LAYERS if num_layers_to_send is None else num_layers_to_send):
            handle.send_layer(layer)
        if num_layers_to_send is None:
            handle.finish(first_token_id=7)

    def prefill_finish(self, request_id: str) -> None:
        self.sends[request_id][0].finish(first_token_id=7)

    def prefill_abort(self, request_id: str) -> KVAbort | None:
        message = self.sender.abort(request_id, "the client cancelled")
        self.sends[request_id][0].cancel()
        return message

    def prefill_cancel_unstarted(self, ticket: KVTicket) -> None:
        """The request ended before its prefill ran: nothing to release, only tell decode."""
        assert self.sender.abort(ticket.request_id, "the client cancelled") is None
        self.sends[ticket.request_id] = (
            self.rank_sender.cancel_unstarted(ticket),
            time.monotonic(),
        )

    def prefill_on_abort(self, message: KVAbort) -> None:
        if self.sender.on_abort(message):
            self.sends[message.request_id][0].cancel()

    def prefill_wait(self, request_id: str) -> dict[str, Any]:
        handle, started = self.sends.pop(request_id)
        error = None
        try:
            handle.wait(60.0)
        except KVTransferError as exc:
            error = exc
        abort = self.sender.on_rank_finished(request_id, 0, None if error is None else str(error))
        return {
            "error": type(error).__name__ if error else None,
            "elapsed_s": time.monotonic() - started,
            "abort": abort,
            "num_free_blocks": self.prefill_pool.num_free_blocks,
            "released": list(self.released),
        }

    def prefill_on_done(self, message: KVTransferDone) -> dict[str, Any]:
        self.sender.on_done(message)
        return self.prefill_status()

    def prefill_status(self) -> dict[str, Any]:
        return {
            "num_free_blocks": self.prefill_pool.num_free_blocks,
            "released": list(self.released),
        }
