"""Events from a worker the request no longer depends on never end or corrupt its stream.

- A prefill instance that fails after the decode instance has started decoding (its TP rank died,
  or it never heard the decode side's ack) sends error events for requests it no longer holds:
  the stream goes on to its end.
- A submit that times out but lands all the same leaves the first prefill instance running the
  request while the router retries on another: that instance's first token, and the decode steps
  it leads to, never reach the retry's stream.

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
from router.synthetic import SyntheticWorker, synthetic_cluster
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
    steps, errors the request as a prefill Worker does when its loop dies (fail_all) or when the
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


class LateAnswerPrefill(SyntheticWorker):
    """A prefill instance that takes the request but answers the submit only after the router's
    worker timeout (a slow pipe, a busy process): the router retries elsewhere while this one
    prefills, emits its first token and hands the KV to the decode instance all the same."""

    answer_after_s = 1.0

    async def submit(self, request: WorkerRequest, ticket: object | None) -> None:
        await super().submit(request, ticket)
        await asyncio.sleep(self.answer_after_s)


def test_a_submit_that_lands_after_its_timeout_never_feeds_the_retry_s_stream(
    tiny_model_dir: str,
) -> None:
    options = {"vocab_size": VOCAB_SIZE, "step_interval_s": 0.02}
    prefills, decodes = synthetic_cluster(2, 1, **options)
    late = LateAnswerPrefill("prefill-0", Role.PREFILL, peers=prefills[0].peers, **options)
    prefills[0] = late  # the least-tokens policy picks prefill-0 first (ties go by id)
    config = RouterConfig(
        model_dir=tiny_model_dir, load_refresh_interval_s=0.02, worker_timeout_s=0.3
    )
    with RouterThread(config, lambda: (prefills, decodes)) as server:
        for _ in range(3):
            assert _generate(server.address) == (_expected_tokens(), pb.FINISH_REASON_LENGTH)
        _wait_for_free_blocks(server)
