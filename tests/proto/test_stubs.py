"""The checked-in API stubs are exactly what `python proto/generate.py` makes from the .proto files."""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import version
from pathlib import Path

import pytest

import proto as proto_plus  # the name proto-plus owns; ours must not shadow it

REPO = Path(__file__).resolve().parents[2]


def _load_generate_module():
    spec = importlib.util.spec_from_file_location(
        "pdserve_generate", REPO / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stamped_grpc_tools_version(stub: Path) -> str:
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", stub.read_text(), re.MULTILINE)
    assert match, f"{stub} has no GRPC_GENERATED_VERSION line"
    return match.group(1)


def test_checked_in_stubs_are_fresh(tmp_path: Path) -> None:
    generate = _load_generate_module()
    fresh_paths = generate.generate(tmp_path)
    assert len(fresh_paths) == 3 * len(generate.proto_files()) >= 3
    checked_in_grpc = REPO / "proto" / fresh_paths[2].relative_to(tmp_path)
    if _stamped_grpc_tools_version(checked_in_grpc) != version("grpcio-tools"):
        pytest.skip(
            f"stubs were made with grpcio-tools {_stamped_grpc_tools_version(checked_in_grpc)}, "
            f"{version('grpcio-tools')} is installed: byte equality needs the same version"
        )
    for fresh in fresh_paths:
        checked_in = REPO / "proto" / fresh.relative_to(tmp_path)
        assert checked_in.exists(), f"{checked_in} is missing: run `python proto/generate.py`"
        assert checked_in.read_bytes() == fresh.read_bytes(), (
            f"{checked_in} is stale: run `python proto/generate.py` and commit the result"
        )


def test_stubs_import_under_our_own_name_and_leave_proto_plus_alone() -> None:
    from pdserve_proto.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert [m.name for m in service.methods] == ["Generate", "GenerateUnary"]
    assert service.methods_by_name["Generate"].server_streaming
    assert not service.methods_by_name["GenerateUnary"].server_streaming
    assert hasattr(generation_pb2_grpc, "GenerationStub")
    # proto-plus still owns `proto`: our package directory did not shadow it.
    assert hasattr(proto_plus, "Message")


def test_request_fields_match_the_documented_api() -> None:
    from pdserve_proto.v1 import generation_pb2

    fields = generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    expected = {
        "prompt",
        "token_ids",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "request_id",
        "ttft_slo_s",
        "tpot_slo_s",
        "logprobs",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logit_bias",
        "n",
        "structured_output",
        "tools",
    }
    assert set(fields) == expected
    # Optional sampling fields keep presence, so "unset" differs from 0.
    request = generation_pb2.GenerateRequest(prompt="hi")
    assert not request.HasField("temperature")
    request.temperature = 0.0
    assert request.HasField("temperature")
    assert not request.HasField("tpot_slo_s")  # unset: the router's default SLO
