"""The HTTP front door over a real disaggregated cluster (a prefill and a decode worker in plain
processes, deploy/runtime/local/local_cluster.py): greedy text through the `openai` SDK equals the gRPC text
and transformers-parity tokens, and a client that disconnects mid-stream, or while its request
waits for its first token, frees every KV block on both workers.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import grpc
import openai
import pytest
import torch
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.local_cluster import LocalCluster
from engine import EngineConfig, SamplingParams
from kv_transfer.config import KVTransferConfig
from router.config import RouterConfig
from tests.engine.test_logprobs_penalties import hf_processed_greedy
from tests.tiny_models import load_hf_model
from worker.config import WorkerConfig

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 128
LONG_MAX_TOKENS = 480  # decoding takes seconds: the client leaves long before the end


def _engine(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[LocalCluster]:
    kv = KVTransferConfig(transfer_timeout_s=10.0)
    spec = ClusterSpec(
        router=RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05),
        prefill=WorkerConfig.prefill(_engine(tiny_model_dir), kv),
        num_prefill_instances=1,
        decode=WorkerConfig.decode(_engine(tiny_model_dir), kv),
        num_decode_instances=1,
    )
    with LocalCluster(spec) as running:
        running.start()
        yield running


def _client(cluster: LocalCluster) -> openai.OpenAI:
    assert cluster.router is not None
    base_url = f"http://127.0.0.1:{cluster.router.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def _model(cluster: LocalCluster) -> str:
    assert cluster.router is not None
    return cluster.router.config.model_name


def _blocks_in_use(cluster: LocalCluster) -> list[int]:
    return [load.num_total_blocks - load.num_free_blocks for load in cluster.status()]


def _wait_for(condition_name: str, check: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {condition_name}")


def _running(cluster: LocalCluster) -> float:
    assert cluster.router is not None
    value = cluster.router.metrics.registry.get_sample_value("pdserve:num_requests_running")
    return value or 0.0


def _num_finished(cluster: LocalCluster) -> float:
    assert cluster.router is not None
    registry = cluster.router.metrics.registry
    value = registry.get_sample_value(
        "pdserve:request_success_total", {"finished_reason": "length"}
    )
    return value or 0.0


def test_greedy_text_through_the_sdk_equals_the_grpc_text(cluster: LocalCluster) -> None:
    prompt = "The quick brown fox"
    with grpc.insecure_channel(cluster.address) as channel:
        request = pb.GenerateRequest(prompt=prompt, max_tokens=16, ignore_eos=True)
        expected = pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=60)
    client = _client(cluster)
    whole = client.completions.create(
        model=_model(cluster),
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == expected.text and expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    streamed = client.completions.create(
        model=_model(cluster),
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text


def test_logprobs_echo_n_and_penalties_across_the_hand_off(
    cluster: LocalCluster, tiny_model_dir: str
) -> None:
    """The prefill instance scores the prompt and ships it with the first token; the decode
    instance scores the rest and applies the penalties: all equal transformers'."""
    prompt_ids = list(range(30, 51))
    client = _client(cluster)
    out = client.completions.create(
        model=_model(cluster),
        prompt=prompt_ids,
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=2,
        frequency_penalty=0.8,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )
    params = SamplingParams(max_tokens=6, frequency_penalty=0.8, repetition_penalty=1.2)
    generated = hf_processed_greedy(tiny_model_dir, prompt_ids, params)
    hf = load_hf_model(tiny_model_dir, torch.float64)
    with torch.no_grad():
        all_ids = prompt_ids + generated
        reference = torch.log_softmax(hf(torch.tensor([all_ids])).logits[0], dim=-1)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs[0] is None
    expected = [float(reference[i - 1, all_ids[i]]) for i in range(1, len(all_ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-9)
    siblings = client.completions.create(
        model=_model(cluster), prompt=prompt_ids, max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in siblings.choices] == [0, 1]
    assert siblings.choices[0].text == siblings.choices[1].text  # greedy: the same text


def test_a_client_that_disconnects_mid_stream_frees_every_kv_block(cluster: LocalCluster) -> None:
    stream = _client(cluster).completions.create(
        model=_model(cluster),
        prompt="Prefill computes the prompt",
        max_tokens=LONG_MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finished_before = _num_finished(cluster)
    chunks = iter(stream)
    for _ in range(3):  # the first token came from prefill; these are decode steps
        next(chunks)
    assert sum(_blocks_in_use(cluster)) > 0  # the decode instance holds the sequence
    stream.close()  # the connection goes away mid-stream
    _wait_for("every block free", lambda: sum(_blocks_in_use(cluster)) == 0)
    _wait_for("no request running in the router", lambda: _running(cluster) == 0)
    assert _num_finished(cluster) == finished_before  # aborted, not run to its end


def test_a_client_that_leaves_while_waiting_for_a_whole_response_frees_every_kv_block(
    cluster: LocalCluster,
) -> None:
    """A non-streaming request has nothing to write until the end: the router must notice the
    closed connection on its own."""
    assert cluster.router is not None
    finished_before = _num_finished(cluster)
    body = json.dumps(
        {
            "model": _model(cluster),
            "prompt": "A router streams tokens to many clients",
            "max_tokens": LONG_MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", cluster.router.http_port), timeout=10) as sock:
        sock.sendall(head + body)
        # Leave as soon as the request holds KV somewhere: on a quiet machine the tiny model
        # decodes all of it in about a second, and waiting for the decode side let it finish.
        _wait_for("the request holding KV", lambda: sum(_blocks_in_use(cluster)) > 0)
    _wait_for("every block free", lambda: sum(_blocks_in_use(cluster)) == 0)
    _wait_for("no request running in the router", lambda: _running(cluster) == 0)
    assert _num_finished(cluster) == finished_before  # aborted, not run to its end
