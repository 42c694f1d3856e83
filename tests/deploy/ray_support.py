"""Helpers for the Ray deployment tests: a tiny model with a tokenizer, its ClusterSpec, gRPC
streams, and checks on listening sockets and processes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import ClusterSpec, build_cluster_spec
from deploy.config.serve_config import parse_config
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.listening import is_loopback, listening_addresses
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

__all__ = ["hf_greedy", "make_prompts"]


def tiny_model_with_tokenizer(folder: Path) -> str:
    """The tiny llama of tests/tiny_models.py with the tiny tokenizer in its folder."""
    return add_tiny_tokenizer(Path(make_tiny_model(folder, "llama")))


def serve_spec(model_dir: str, **sections: Any) -> ClusterSpec:
    """The ClusterSpec of a serve config written as its YAML mapping (dtype="float64",
    prefill={"tensor_parallel_size": 2}, ...); the router binds a free port unless told."""
    router = {"port": 0, **sections.pop("router", {})}
    return build_cluster_spec(parse_config({"model": model_dir, "router": router, **sections}))


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    num_messages: int = 0


def stream(
    address: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 60.0,
    started: list[int] | None = None,
) -> StreamResult:
    """One greedy Generate stream over a real gRPC channel; `started` gets 1 appended at the
    first message (so a test can act while streams are running)."""
    result = StreamResult()
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        try:
            for message in pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s):
                result.token_ids.extend(message.token_ids)
                result.num_messages += 1
                if result.num_messages == 1 and started is not None:
                    started.append(1)
        except grpc.RpcError as error:
            result.code, result.details = error.code(), error.details() or ""
    return result


def stream_all(address: str, prompts: list[list[int]], max_tokens: int) -> list[StreamResult]:
    """Every prompt as its own concurrent stream."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: stream(address, prompt, max_tokens), prompts))


def non_loopback_listeners(pids: list[int]) -> list[str]:
    return [address for address in listening_addresses(pids) if not is_loopback(address)]
