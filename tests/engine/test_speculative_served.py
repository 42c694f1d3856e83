"""Speculation on a served disaggregated cluster, in real processes: a prefill instance (TP=1)
hands each request's KV to a decode instance at TP=2 that speculates from the request's first
decode step, by prompt lookup or with a draft model (the target's first layer, which catches up
on the prompt on its first step). Its pool is too small for the batch, so it preempts
mid-speculation. Tokens equal
transformers' float64 greedy ones, the decode instance reports proposed and accepted tokens,
and every pool comes back whole.
"""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.speculative.layer_skip import build_layer_skip_draft
from kv_transfer.config import KVTransferConfig
from tests.engine.test_llm import hf_greedy
from tests.engine.test_speculative import BASE
from tests.workers.cluster import Cluster, Relay, free_blocks, make_requests, wait_for
from worker.config import WorkerConfig
from worker.protocol import Load, TokenEvent

pytestmark = pytest.mark.slow

MAX_TOKENS = 40


def engine_config(model_dir: str, **overrides: object) -> EngineConfig:
    kwargs: dict[str, object] = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 64}
    kwargs.update(overrides)
    return EngineConfig(model_dir=model_dir, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("family", "method"),
    [("llama", "ngram"), ("qwen2", "ngram"), ("mistral", "ngram"), ("llama", "draft")],
)
def test_served_speculation_equals_transformers(
    tiny_model, tmp_path, family: str, method: str
) -> None:
    model_dir = tiny_model(family)
    spec = SpeculativeConfig(num_tokens=4, prompt_lookup_max=3)
    if method == "draft":
        draft_dir = build_layer_skip_draft(model_dir, tmp_path / "draft", 1)
        spec = SpeculativeConfig(method="draft", draft_model=draft_dir, num_tokens=4)
    first = hf_greedy(model_dir, BASE, 24)
    prompts = [p + o + p for p, o in zip(BASE, first, strict=True)]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    prefill = engine_config(model_dir)
    decode = engine_config(
        model_dir,
        tensor_parallel_size=2,
        num_kv_blocks=24,
        speculative=spec,
    )
    cluster = Cluster()
    try:
        cluster.start(
            [
                ("prefill", WorkerConfig.prefill(prefill)),
                ("decode", WorkerConfig.decode(decode, KVTransferConfig(transfer_timeout_s=10.0))),
            ]
        )
        start_free = {i: free_blocks(cluster, i) for i in cluster.workers}
        relay = Relay(cluster, "prefill", ["decode"], 1)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        finals: list[TokenEvent] = []  # each request's last decode event, with its timings
        results = relay.run(
            make_requests(prompts, params, "spec"),
            timeout_s=180.0,
            on_poll=lambda events: finals.extend(
                e for e in events if e.finish_reason and e.source == "decode"
            ),
        )
        assert [r.token_ids for r in results.values()] == expected
        load = relay.worker("decode").call(Load())
        proposed = load.details.num_spec_proposed_tokens
        accepted = load.details.num_spec_accepted_tokens
        if method == "ngram":  # the prompts repeat themselves: lookup accepts some, not all
            assert 0 < accepted < proposed, (proposed, accepted)
        else:  # a one-layer draft of random weights may agree on none of its probes, after
            # which the cost check stops it (under load the probes are all there is)
            assert proposed > 0 and 0 <= accepted < proposed, (proposed, accepted)
        # per request in the timings (what the router's usage reports), adding up
        assert len(finals) == len(prompts)
        assert sum(e.timings.num_spec_proposed_tokens for e in finals if e.timings) == proposed
        assert sum(e.timings.num_spec_accepted_tokens for e in finals if e.timings) == accepted
        assert load.num_preemptions > 0
        for instance_id, start in start_free.items():
            wait_for(
                lambda i=instance_id, n=start: free_blocks(cluster, i) == n,
                15.0,
                f"{instance_id} back to {start} free blocks",
            )
    finally:
        cluster.shutdown()
        for worker in list(cluster.workers.values()):
            worker.kill()
