"""Prometheus metrics of one router, named like vLLM's with a `pdserve:` prefix.

Each router owns its registry (so several routers can live in one test process); the router
serves it on its metrics port (router/metrics_http.py) when one is configured.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.worker_api import InstanceLoad, Role

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.time_to_first_token = histogram(
            "pdserve:time_to_first_token_seconds", "Accepted to first token sent, seconds."
        )
        self.time_per_output_token = histogram(
            "pdserve:time_per_output_token_seconds",
            "Mean time per output token after the first, per request, seconds.",
        )
        self.inter_token_latency = histogram(
            "pdserve:inter_token_latency_seconds", "Time between consecutive token messages."
        )
        self.e2e_request_latency = histogram(
            "pdserve:e2e_request_latency_seconds", "Accepted to last token, seconds."
        )
        self.request_queue_time = histogram(
            "pdserve:request_queue_time_seconds", "Time waiting in the router's queue, seconds."
        )
        self.kv_transfer_time = histogram(
            "pdserve:kv_transfer_seconds", "Per-request KV transfer time reported by workers."
        )
        self.num_requests_waiting = Gauge(
            "pdserve:num_requests_waiting", "Requests queued in the router.", registry=self.registry
        )
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running",
            "Requests dispatched to workers, not finished.",
            registry=self.registry,
        )
        self.request_success = Counter(
            "pdserve:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.request_failure = Counter(
            "pdserve:request_failure",
            "Requests that ended with a non-OK gRPC status, by status code.",
            ["code"],
            registry=self.registry,
        )
        self.request_retries = Counter(
            "pdserve:request_retries",
            "Placements lost before the request's first token and placed again.",
            registry=self.registry,
        )
        self.request_migrations = Counter(
            "pdserve:request_migrations",
            "Streams moved to another instance after the one decoding them was lost.",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of admitted requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens generated.", registry=self.registry
        )
        self._init_worker_gauges()
        self._init_placement_metrics(histogram)

    def _init_placement_metrics(self, histogram: Callable[[str, str], Histogram]) -> None:
        """An adaptive cluster's decisions (router/adaptive/placer.py)."""
        self.placements = Counter(
            "pdserve:placements",
            "Requests placed by an adaptive cluster, by kind (local: "
            "prefill and decode on one instance; remote: KV moved).",
            ["kind"],
            registry=self.registry,
        )
        self.predicted_ttft = histogram(
            "pdserve:placement_predicted_ttft_seconds", "TTFT predicted at placement, seconds."
        )
        self.predicted_tpot = histogram(
            "pdserve:placement_predicted_tpot_seconds", "TPOT predicted at placement, seconds."
        )
        self.prefill_role_instances = Gauge(
            "pdserve:prefill_role_instances",
            "Adaptive instances that take remote prefills (the rest decode).",
            registry=self.registry,
        )
        self.latency_model_speed = Gauge(
            "pdserve:latency_model_speed",
            "Measured over profiled prefill time: the factor the placer's model runs at.",
            registry=self.registry,
        )

    def observe_placement(
        self, kind: str, ttft_s: float, tpot_s: float, roles: int, speed: float
    ) -> None:
        self.placements.labels(kind).inc()
        self.predicted_ttft.observe(ttft_s)
        self.predicted_tpot.observe(tpot_s)
        self.prefill_role_instances.set(roles)
        self.latency_model_speed.set(speed)

    def _init_worker_gauges(self) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["instance", "role"], registry=self.registry)

        self.worker_waiting = gauge("pdserve:worker_num_requests_waiting", "Queued in a worker.")
        self.worker_running = gauge("pdserve:worker_num_requests_running", "Running in a worker.")
        self.worker_blocks_used = gauge("pdserve:kv_blocks_used", "KV blocks in use per worker.")
        self.worker_blocks_total = gauge("pdserve:kv_blocks_total", "KV blocks per worker.")
        self.worker_healthy = gauge("pdserve:worker_healthy", "1 when the worker is healthy.")
        self.worker_node = Gauge(
            "pdserve:worker_node",
            "1 for the node each worker runs on (its host; under Ray: IP and node id).",
            ["instance", "role", "node"],
            registry=self.registry,
        )
        self._nodes: dict[str, str] = {}  # instance id -> the node label set
        self.kv_link = Gauge(
            "pdserve:kv_link",
            "1 for the transport each prefill-decode rank pair's KV runs on (cuda-ipc, "
            "shared-memory, nccl, gloo), as its prefill instance reports it.",
            ["instance", "pair", "transport"],
            registry=self.registry,
        )
        self._links: dict[tuple[str, str], str] = {}  # (instance, pair) -> transport label set
        # Prefix-cache tokens, as vLLM's prefix_cache_queries / prefix_cache_hits (their ratio
        # is the hit rate KV-aware routing raises).
        self.prefix_cache_queries = gauge(
            "pdserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = gauge(
            "pdserve:prefix_cache_hits_total", "Prompt tokens whose KV the prefix cache held."
        )
        # The SLO scheduler's (engine/slo.py) holds and its own decode-step estimate.
        self.prefill_chunks_held = gauge(
            "pdserve:prefill_chunks_held_total",
            "Prompt chunks the worker's SLO gate held back a step for a tight decode.",
        )
        self.decode_step_seconds = gauge(
            "pdserve:decode_step_seconds", "The decode step the worker measures at its batch."
        )
        # Speculative decoding (engine/speculative/), as vLLM's spec_decode_num_draft_tokens /
        # num_accepted_tokens, and their ratio.
        self.spec_proposed = gauge(
            "pdserve:spec_decode_num_draft_tokens_total", "Tokens proposed for verification."
        )
        self.spec_accepted = gauge(
            "pdserve:spec_decode_num_accepted_tokens_total", "Proposed tokens the model accepted."
        )
        self.spec_acceptance = gauge(
            "pdserve:spec_decode_acceptance_rate", "Accepted over proposed tokens, cumulative."
        )

    def observe_load(self, load: InstanceLoad) -> None:
        labels = (load.instance_id, load.role.value)
        self.worker_waiting.labels(*labels).set(load.num_waiting_requests)
        self.worker_running.labels(*labels).set(load.num_running)
        self.worker_blocks_used.labels(*labels).set(load.num_total_blocks - load.num_free_blocks)
        self.worker_blocks_total.labels(*labels).set(load.num_total_blocks)
        self.worker_healthy.labels(*labels).set(1.0 if load.healthy else 0.0)
        details = load.details
        self._observe_node(load.instance_id, load.role, details.node)
        for pair, transport in details.kv_links:
            previous = self._links.get((load.instance_id, pair))
            if previous != transport:
                if previous is not None:
                    self.kv_link.remove(load.instance_id, pair, previous)
                self._links[(load.instance_id, pair)] = transport
                self.kv_link.labels(load.instance_id, pair, transport).set(1.0)
        self.prefix_cache_queries.labels(*labels).set(details.num_prefix_queried_tokens)
        self.prefix_cache_hits.labels(*labels).set(details.num_prefix_hit_tokens)
        if details.num_held_chunks is not None:
            self.prefill_chunks_held.labels(*labels).set(details.num_held_chunks)
        if details.decode_step_s is not None:
            self.decode_step_seconds.labels(*labels).set(details.decode_step_s)
        proposed, accepted = details.num_spec_proposed_tokens, details.num_spec_accepted_tokens
        if proposed is not None and accepted is not None:
            self.spec_proposed.labels(*labels).set(proposed)
            self.spec_accepted.labels(*labels).set(accepted)
            self.spec_acceptance.labels(*labels).set(accepted / proposed if proposed else 0.0)

    def _observe_node(self, instance_id: str, role: Role, node: str) -> None:
        """One series per worker: a worker restarted on another node moves its series there."""
        previous = self._nodes.get(instance_id)
        if previous == node:
            return
        if previous is not None:
            self.worker_node.remove(instance_id, role.value, previous)
        self._nodes[instance_id] = node
        self.worker_node.labels(instance_id, role.value, node).set(1.0)

    def observe_down(self, instance_id: str, role: Role) -> None:
        """A worker that does not answer: down, and holding nothing (a dead process holds no
        requests or blocks; a restarted one reports its own loads again)."""
        labels = (instance_id, role.value)
        self.worker_healthy.labels(*labels).set(0.0)
        self.worker_waiting.labels(*labels).set(0)
        self.worker_running.labels(*labels).set(0)
        self.worker_blocks_used.labels(*labels).set(0)
