"""A hypothesis fuzzer over GenerateRequest against a real router on 127.0.0.1, with synthetic
workers: every field with valid, edge and out-of-range values, huge strings, invalid UTF-8 and
bytes that are no protobuf message at all, each sent through both Generate and GenerateUnary.

Each case gets INVALID_ARGUMENT naming a field that breaks a rule (tests/router/fuzz_requests.py
says which), or "not a well-formed" for bytes that do not parse, or OK with a finish reason;
never INTERNAL, UNKNOWN or a hang. Afterwards the server is healthy, holds no request, and every
worker's KV pool is back to its start count. The examples are derandomized, so CI sees the same
5,000 cases (2 methods x (1,300 + 700 + 500) requests) every run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from pdserve_proto.v1 import generation_pb2 as pb

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from router.tokenizer import RouterTokenizer
from router.worker_api import InstanceLoad
from tests.router.fuzz_requests import expected, generate_requests, named_fields
from tests.router.fuzz_wire import RawRequest, garbled_bytes, raw_requests
from tests.router.harness import RouterThread

_TIMEOUT_S = 20.0  # per call: far above any answer's time; reaching it is a hang
_NOT_WELL_FORMED = "the request is not a well-formed pdserve.v1.GenerateRequest message"
_BAD_UTF8 = re.compile(
    r"^(prompt|request_id|stop\[\d+\]|messages\[\d+\]\.(role|content)) \(byte \d+\) is not valid "
    r"UTF-8; send text encoded as UTF-8$"
)
Outcome = tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]  # code, details, responses
_FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same cases on every run and machine
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)


class Fuzzed:
    """The router under fuzz, and sync calls that send a request through both methods at once."""

    def __init__(
        self, server: RouterThread, channel: grpc.Channel, start_loads: list[InstanceLoad]
    ) -> None:
        self.server = server
        self.channel = channel
        self.start_loads = start_loads
        self._unary = channel.unary_unary("/pdserve.v1.Generation/GenerateUnary")
        self._stream = channel.unary_stream("/pdserve.v1.Generation/Generate")

    def both(self, data: bytes) -> list[Outcome]:
        """(code, details, responses) from Generate, then from GenerateUnary."""
        unary = self._unary.future(data, timeout=_TIMEOUT_S)

        def stream() -> list[pb.GenerateResponse]:
            return [
                pb.GenerateResponse.FromString(r) for r in self._stream(data, timeout=_TIMEOUT_S)
            ]

        def unary_result() -> list[pb.GenerateResponse]:
            return [pb.GenerateResponse.FromString(unary.result(timeout=_TIMEOUT_S))]

        return [_outcome(stream), _outcome(unary_result)]


def _outcome(call: Callable[[], list[pb.GenerateResponse]]) -> Outcome:
    try:
        return grpc.StatusCode.OK, "", call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []
    except grpc.FutureTimeoutError:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the test's wait timed out", []


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir: str) -> Iterator[Fuzzed]:
    config = RouterConfig(model_dir=tiny_model_dir, default_max_tokens=2)
    make_handles = lambda: synthetic_cluster(  # noqa: E731
        1, 1, step_interval_s=0.001, prefill_delay_s=0.0
    )
    with RouterThread(config, make_handles) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield Fuzzed(server, channel, server.loads())


def _check_against_oracle(
    outcomes: list[Outcome],
    request: pb.GenerateRequest,
    tokenizer: RouterTokenizer,
) -> None:
    rule = expected(request, tokenizer)
    for call, (code, details, responses) in zip(("stream", "unary"), outcomes, strict=True):
        refused_for = rule.refused_for
        if not refused_for and rule.n > 1 and call == "unary":
            refused_for = frozenset({"n"})  # n > 1 streams its completions apart: Generate
        if refused_for:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, rule)
            named = named_fields(details)
            assert named & refused_for, (details, refused_for)
            continue
        assert code == grpc.StatusCode.OK, (code, details)
        completions: dict[int, list[pb.GenerateResponse]] = {}
        for response in responses:
            completions.setdefault(response.index, []).append(response)
        assert sorted(completions) == list(range(rule.n)), sorted(completions)
        for completion in completions.values():
            last = completion[-1]
            assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
            num_tokens = sum(len(r.token_ids) for r in completion)
            assert 1 <= num_tokens == last.usage.completion_tokens <= rule.max_tokens


@settings(_FUZZ, max_examples=1300)
@given(request=generate_requests())
def test_fuzzed_requests_are_refused_by_field_or_answered(
    fuzzed: Fuzzed, tokenizer: RouterTokenizer, request: pb.GenerateRequest
) -> None:
    outcomes = fuzzed.both(request.SerializeToString())
    _check_against_oracle(outcomes, request, tokenizer)


@settings(_FUZZ, max_examples=700)
@given(raw=raw_requests())
def test_fuzzed_wire_bytes_name_the_field_that_is_not_utf8(
    fuzzed: Fuzzed, tokenizer: RouterTokenizer, raw: RawRequest
) -> None:
    outcomes = fuzzed.both(raw.data)
    if raw.first_bad_utf8 is None:  # well-formed: it parses, and is judged like any request
        _check_against_oracle(outcomes, pb.GenerateRequest.FromString(raw.data), tokenizer)
        return
    message = f"{raw.first_bad_utf8} is not valid UTF-8; send text encoded as UTF-8"
    assert [(code, details) for code, details, _ in outcomes] == [
        (grpc.StatusCode.INVALID_ARGUMENT, message)
    ] * 2


@settings(_FUZZ, max_examples=500)
@given(data=garbled_bytes())
def test_garbled_bytes_are_refused_as_malformed_or_judged_as_parsed(
    fuzzed: Fuzzed, tokenizer: RouterTokenizer, data: bytes
) -> None:
    outcomes = fuzzed.both(data)
    try:
        request = pb.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 (DecodeError; protobuf's parser raises nothing else here)
        for code, details, _ in outcomes:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert details == _NOT_WELL_FORMED or _BAD_UTF8.match(details), details
        return
    _check_against_oracle(outcomes, request, tokenizer)


def test_after_the_fuzzing_the_server_is_healthy_and_holds_nothing(fuzzed: Fuzzed) -> None:
    """Runs after the fuzzers (pytest keeps the file's order)."""
    health = health_pb2_grpc.HealthStub(fuzzed.channel)
    answer = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 10
    while True:  # the last requests' aborts may still be on their way
        loads = fuzzed.server.loads()
        if all(_idle(load) for load in loads) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    start = [(load.instance_id, load.num_total_blocks) for load in fuzzed.start_loads]
    assert start == [(load.instance_id, load.num_free_blocks) for load in loads]
    assert all(_idle(load) for load in loads), loads
    assert fuzzed.server.router is not None
    admission = fuzzed.server.router.admission
    assert (admission.num_running, admission.num_waiting) == (0, 0)  # no call still held


def _idle(load: InstanceLoad) -> bool:
    busy = load.num_running or load.num_waiting_requests
    return not busy and load.num_free_blocks == load.num_total_blocks
