"""Speculation through the whole served path (serve config -> router -> workers, plain
processes), by prompt lookup and with a draft model (the target's first layer), with a decode
instance SIGKILLed while its streams speculate: the streams migrate
to the other decode instance, which speculates too, and finish token for token what
transformers generates. The gRPC usage reports the tokens proposed and accepted per request,
a cancelled stream ends cleanly, and every pool is back to its start count afterwards.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.local.local_cluster import LocalCluster
from engine.speculative.layer_skip import build_layer_skip_draft
from tests.deploy.ray_support import hf_greedy, serve_spec, tiny_model_with_tokenizer
from tests.deploy.test_recovery import _all_back, _start_all, _wait_until
from tests.engine.test_llm import make_prompts

pytestmark = pytest.mark.slow

LONG_TOKENS = 300  # long enough to kill a decode instance while these stream
BASE = make_prompts((9, 14, 5, 11), seed=4)
PROMPTS = [p + p + p for p in BASE]  # something to copy from the first decode step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("spec-recovery"))


@pytest.fixture(scope="module", params=["ngram", "draft"])
def cluster(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalCluster]:
    speculative: dict[str, object] = {"method": "ngram", "num_tokens": 4, "prompt_lookup_max": 3}
    if request.param == "draft":
        draft = build_layer_skip_draft(model_dir, tmp_path_factory.mktemp("draft") / "d", 1)
        speculative = {"method": "draft", "draft_model": draft, "num_tokens": 4}
    spec = serve_spec(
        model_dir,
        dtype="float64",
        decode={"instances": 2},
        kv_cache={"block_size": 8, "num_blocks": 256},
        kv_transfer={"transfer_timeout_s": 5.0, "start_timeout_s": 8.0},
        router={"worker_timeout_s": 5.0, "shutdown_grace_s": 1.0},
        speculative=speculative,
        ray={"enabled": False},
    )
    with LocalCluster(spec) as running:
        running.start()
        yield running


def test_speculating_streams_migrate_and_equal_transformers(
    cluster: LocalCluster, model_dir: str
) -> None:
    expected = hf_greedy(model_dir, PROMPTS, LONG_TOKENS)
    results, started, threads = _start_all(cluster, PROMPTS, LONG_TOKENS)
    _wait_until(lambda: len(started) == len(PROMPTS), 60, "every stream started")
    # a stream's first token comes from the prefill; its decode runs once the KV has landed
    running: dict[str, int] = {}

    def some_decode_runs() -> bool:
        running.clear()
        running.update({load.instance_id: load.num_running for load in cluster.status()})
        return running.get("decode-0", 0) + running.get("decode-1", 0) > 0

    _wait_until(some_decode_runs, 60, "a decode instance runs streams")
    victim = max(("decode-0", "decode-1"), key=lambda i: running.get(i, 0))
    os.kill(cluster.workers[victim].pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == expected
    assert any(r.last and r.last.timings.migrations for r in results)
    usage = [r.last.usage for r in results if r.last is not None]
    assert sum(u.spec_proposed_tokens for u in usage) > 0
    assert all(u.spec_accepted_tokens <= u.spec_proposed_tokens for u in usage)
    # streams cancelled by their client mid-speculation free their blocks too
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [
            stub.Generate(
                pb.GenerateRequest(token_ids=p, max_tokens=LONG_TOKENS, ignore_eos=True),
                timeout=120,
            )
            for p in PROMPTS[:2]
        ]
        for call in calls:
            for _ in range(5):
                next(call)  # a few messages in: it is decoding (and speculating)
            call.cancel()
    _wait_until(lambda: _all_back(cluster), 180, "the restart, every block back")
