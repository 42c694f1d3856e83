"""The router's configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

PREFILL_POLICIES = ("least_tokens", "round_robin", "kv_aware")
DECODE_POLICIES = ("least_batch", "most_free_blocks")


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, admits and dispatches.

    `port=0` (and `metrics_port=0`) bind a free port; the server reports the one it got.
    Every host defaults to loopback: nothing listens off this machine unless configured.
    `metrics_port=None` serves no metrics over HTTP (they are still collected).
    `http_port` serves the OpenAI-compatible HTTP API (router/http_api) on `http_host`, beside
    gRPC and over the same admission, dispatch and metrics; None turns it off. It takes the same
    bearer token and TLS files as gRPC. Its models list names the model `served_model_name`
    (None: the model folder's name).
    HTTP abuse bounds: a request body over `http_max_body_bytes` gets 413 while it is read, before
    it is parsed (the default is gRPC's 4 MiB message limit: a prompt the gRPC API takes fits, with
    room for JSON's escapes); a client gets `http_header_timeout_s` from its connection (or a
    keep-alive request's first byte) to send the whole request head, and at most
    `http_body_timeout_s` between two reads of its body; past either the connection is closed, so
    a client that stops mid-request (a slowloris) holds no socket for long.
    Auth: with `auth_token` set, every gRPC method (health and server reflection included) and
    every HTTP API route needs `authorization: Bearer <token>`. `auth_exempt_health` leaves the
    gRPC health service and the HTTP API's /health open, for probes that cannot send a token
    (Kubernetes' gRPC probe sends no metadata); `auth_exempt_reflection` leaves gRPC server
    reflection open, for tools such as grpcurl (it tells no more than the published .proto
    files). Metrics (the metrics port, and the HTTP API's /metrics) need the token, and TLS when
    configured, only on a non-loopback host: on loopback only processes of this machine reach
    them, a node-local scraper then needs no secret, and they hold counts and latencies, never a
    request's content.
    Admission: at most `max_running_requests` are dispatched to workers at once and at most
    `max_queued_requests` more wait in the router; past that a request gets RESOURCE_EXHAUSTED
    at once. A dispatched request that no worker has KV space for goes back to wait in a queue
    place until a request ends (RESOURCE_EXHAUSTED only without a free place, past its deadline,
    or when no worker's whole pool could hold its prompt). `max_model_len` must match the workers' (None: the model's max_position_embeddings).
    `block_size` must match the workers' KV block size (the kv_aware policy hashes prompt
    blocks the way their prefix caches do).
    A prompt longer than `max_prompt_chars_per_token * max_model_len` characters is refused before
    it is tokenized (a generous bound: real text averages a few characters per token).
    Structured output (router/structured.py): a schema, regex or grammar over `max_grammar_chars`
    characters, or one that does not compile within `grammar_compile_timeout_s`, is refused.
    A completions request holds at most `max_prompts_per_request` prompts (a batch).
    Recovery (router/recovery.py): a request whose instance is lost, or whose KV hand-off fails,
    is placed again (before its first token) or moved (after it) at most `max_retries` times in
    all; 0 turns that off. A request that finds no healthy instance to take it, at dispatch or
    after a failure, waits up to `recovery_wait_s` for one to come back (a restarted worker),
    never past the client's deadline; 0 fails it at once with UNAVAILABLE.
    Adaptive placement (a cluster of Role.ADAPTIVE instances, router/adaptive/placer.py) predicts each
    request's TTFT and TPOT with the latency model in `latency_profile` (a profile file that
    `pdserve profile` writes; `latency_profile_model` names the model when it holds several),
    corrected online by the workers' measured step times, against the request's own SLOs or, when
    it sets none, `default_ttft_slo_s` and `default_tpot_slo_s`; instance roles follow the
    arrivals of the last `adaptive_window_s`.
    """

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    served_model_name: str | None = None
    http_max_body_bytes: int = 4 * 1024 * 1024
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    auth_token: str | None = None
    auth_exempt_health: bool = False
    auth_exempt_reflection: bool = False
    max_model_len: int | None = None
    block_size: int = 16
    prefill_policy: str = "least_tokens"
    decode_policy: str = "least_batch"
    max_running_requests: int = 256
    max_queued_requests: int = 256
    default_max_tokens: int = 16
    max_stop_strings: int = 16
    max_prompt_chars_per_token: int = 32
    max_grammar_chars: int = 256 * 1024
    max_prompts_per_request: int = 256
    grammar_compile_timeout_s: float = 10.0
    load_refresh_interval_s: float = 0.1
    poll_timeout_s: float = 0.5
    worker_timeout_s: float = 10.0
    shutdown_grace_s: float = 5.0
    max_retries: int = 3
    recovery_wait_s: float = 30.0
    latency_profile: str | None = None
    latency_profile_model: str | None = None
    default_ttft_slo_s: float = 2.0
    default_tpot_slo_s: float = 0.1
    adaptive_window_s: float = 10.0
    # The cluster-level split of router/adaptive/layout_model.py: the adaptive instances split into
    # prefill-only and decode-only ones while the local layout's requests end at risk and the
    # split predicts them safe (off: every request chooses its own placement, always).
    adaptive_layout_search: bool = True

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model_dir):
            raise ValueError(
                f"model_dir {self.model_dir!r} is not a folder (it holds the tokenizer)"
            )
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
                raise ValueError(f"{name} must be an integer in [0, 65535], got {value!r}")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError(f"http_port {self.http_port} is also the gRPC or metrics port")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty; use None for the folder's name")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file (or neither)")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} does not exist")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be empty; use None to turn auth off")
        for name in ("auth_exempt_health", "auth_exempt_reflection"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_positive_ints()
        self._check_positive_floats()
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(
                f"prefill_policy must be one of {PREFILL_POLICIES}, got {self.prefill_policy!r}"
            )
        if self.latency_profile is not None and not os.path.isfile(self.latency_profile):
            raise ValueError(
                f"latency_profile {self.latency_profile!r} is not a file: write one with "
                "`pdserve profile`, or leave it unset (adaptive placement needs it)"
            )
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"decode_policy must be one of {DECODE_POLICIES}, got {self.decode_policy!r}"
            )

    def _check_positive_ints(self) -> None:
        names = (
            "block_size",
            "max_running_requests",
            "default_max_tokens",
            "max_stop_strings",
            "max_prompt_chars_per_token",
            "http_max_body_bytes",
            "max_grammar_chars",
            "max_prompts_per_request",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_prompts_per_request > 4096:  # what the HTTP schema validates at most
            raise ValueError(
                f"max_prompts_per_request must be at most 4096, got {self.max_prompts_per_request}"
            )
        for name in ("max_queued_requests", "max_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    def _check_positive_floats(self) -> None:
        names = (
            "load_refresh_interval_s",
            "poll_timeout_s",
            "worker_timeout_s",
            "shutdown_grace_s",
            "default_ttft_slo_s",
            "default_tpot_slo_s",
            "adaptive_window_s",
            "http_header_timeout_s",
            "http_body_timeout_s",
            "grammar_compile_timeout_s",
        )
        for name in names:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        for name in ("default_ttft_slo_s", "default_tpot_slo_s"):  # as a request's own SLOs
            value = getattr(self, name)
            if not value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        if not self.recovery_wait_s >= 0:
            raise ValueError(f"recovery_wait_s must be >= 0 seconds, got {self.recovery_wait_s!r}")

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def metrics_public(self) -> bool:
        """Whether the metrics port takes the bearer token and TLS (those configured)."""
        return not is_loopback_host(self.metrics_host)

    @property
    def http_metrics_need_auth(self) -> bool:
        """Whether the HTTP API's /metrics needs the bearer token."""
        return self.auth_token is not None and not is_loopback_host(self.http_host)

    @property
    def model_name(self) -> str:
        """The name the HTTP API lists and expects in a request's `model` field."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir))


def is_loopback_host(host: str) -> bool:
    """Whether a listening address is reachable from this machine only ("localhost", 127.0.0.0/8,
    ::1). The empty host, "0.0.0.0" and "::" listen on every interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public address
