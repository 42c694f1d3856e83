"""Events from a worker the request no longer depends on never end or corrupt its stream.

- A prefill instance that fails after the decode instance has started decoding (its TP rank died,
  or it never heard the decode side's ack) sends error events for requests it no longer holds:
  the stream goes on to its end.

Real router on 127.0.0.1 over synthetic workers (router/synthetic.py), so each case is forced
deterministically.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import SyntheticWorker
from router.worker_api import Role, TokenEvent, WorkerRequest
from tests.router.harness import RouterThread

PROMPT = [1, 40, 41, 42, 43]
MAX_TOKENS = 20
VOCAB_SIZE = 512


def _expected_tokens() -> list[int]:
    """What the synthetic workers emit for PROMPT (router/synthetic.py's token rule)."""
    return [3 + (sum(PROMPT) + i) % (VOCAB_SIZE - 3) for i in range(MAX_TOKENS)]


def _generate(address: str) -> tuple[list[int], int]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        token_ids: list[int] = []
        finish_reason = pb.FINISH_REASON_UNSPECIFIED
        for response in stub.Generate(request, timeout=20):
            token_ids += response.token_ids
            finish_reason = response.finish_reason
    return token_ids, finish_reason


def _wait_for_free_blocks(server: RouterThread, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    loads = server.loads()
    while any(load.num_free_blocks != load.num_total_blocks for load in loads):
        assert time.monotonic() < deadline, f"blocks still held: {loads}"
        time.sleep(0.02)
        loads = server.loads()


class FailingAfterDecodeStarts(SyntheticWorker):
    """A prefill instance that hands the KV off, then, once the decode instance has sent a few
    steps, errors the request as PrefillWorker does when its loop dies (fail_all) or when the
    decode side's ack never reached it (`failed_peer` names the decode instance)."""

    failed_peer = ""

    async def _prefill(self, request: WorkerRequest, ticket: object | None) -> None:
        await super()._prefill(request, ticket)
        decode = self.peers[str(ticket)]
        for _ in range(500):  # until the decode instance has emitted three steps (<= 5 s)
            sequence = decode._sequences.get(request.request_id)
            if sequence is None or sequence.num_emitted >= 4:
                break
            await asyncio.sleep(0.01)
        error = TokenEvent(request.request_id, [], "error", "TP rank 1 died", self.instance_id)
        error.failed_peer = self.failed_peer
        self._events.append(error)
        self._wakeup.set()


@pytest.mark.parametrize("failed_peer", ["", "decode-0"])
def test_a_prefill_error_after_decoding_started_does_not_end_the_stream(
    tiny_model_dir: str, failed_peer: str
) -> None:
    decode = SyntheticWorker("decode-0", Role.DECODE, vocab_size=VOCAB_SIZE, step_interval_s=0.02)
    prefill = FailingAfterDecodeStarts(
        "prefill-0", Role.PREFILL, vocab_size=VOCAB_SIZE, peers={"decode-0": decode}
    )
    prefill.failed_peer = failed_peer
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.02)
    with RouterThread(config, lambda: ([prefill], [decode])) as server:
        assert _generate(server.address) == (_expected_tokens(), pb.FINISH_REASON_LENGTH)
        _wait_for_free_blocks(server)
