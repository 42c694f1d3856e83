"""The router as a running gRPC server: Generation, health, reflection, metrics, auth, TLS.

    router = Router(config, prefill_handles, decode_handles)   # decode_handles=() when colocated
    await router.start()            # binds config.host:config.port (port 0: a free one)
    print(router.address)           # "127.0.0.1:50123"
    ...
    await router.stop()             # NOT_SERVING, drain for shutdown_grace_s, abort the rest

With `config.http_port` set, the OpenAI-compatible HTTP API (router/http_api) listens too, on
the same event loop and over the same runner; `router.http_port` is the port it got.

Auth: with `config.auth_token` set, every gRPC method needs the bearer token, except health and
reflection when the configuration leaves them open; the metrics port needs it on a public host
(RouterConfig's docstring says why loopback stays open).

Health: the overall status ("") and "pdserve.v1.Generation" are SERVING while the workers can
take requests (a healthy prefill or colocated instance, plus a decode instance when split), and
NOT_SERVING otherwise; the status follows each load refresh. Where grpcio-health-checking or
grpcio-reflection is not installed (the GPU image), the router serves neither and logs so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from router.adaptive import RequestSLO, adaptive_placer
from router.admission import AdmissionController
from router.auth import BearerTokenInterceptor
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.generation import GenerationRunner
from router.metrics import RouterMetrics
from router.metrics_http import MetricsHttpServer
from router.policies import make_decode_policy, make_prefill_policy
from router.prefix_index import PrefixIndex
from router.servicer import SERVICE_NAME, GenerationServicer
from router.tokenizer import RouterTokenizer, load_model_limits
from router.validation import RequestValidator
from router.worker_api import DecodeHandle, PrefillHandle
from router.worker_pool import WorkerPool

try:  # declared dependencies, absent from the GPU image that benchmarks/gpu_checks.sh runs on
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio
    from grpc_reflection.v1alpha import reflection

    HAS_HEALTH_SERVICES = True
except ModuleNotFoundError:
    HAS_HEALTH_SERVICES = False

if TYPE_CHECKING:  # the HTTP API (FastAPI, uvicorn) is imported only when it listens
    from starlette.types import ASGIApp

    from router.http_api.server import HttpServer

logger = logging.getLogger(__name__)
# gRPC core holds calls that arrived before the server asked for them (the aio server accepts
# one call per event-loop turn, so a burst waits there) and, past its default of 1,000 such
# calls, cancels them at random with a bare CANCELLED. A refused call must get admission
# control's RESOURCE_EXHAUSTED and message instead, so the bound sits a few times above what
# admission holds; yet it is a bound: each waiting call may hold a message of up to 4 MB.
_MIN_PENDING_CALLS = 2048  # twice gRPC core's default: a burst of a few thousand is normal
_PENDING_CALLS_PER_ADMITTED = 4


def max_pending_calls(config: RouterConfig) -> int:
    """How many calls gRPC core may hold before the server takes them (past it: CANCELLED)."""
    admitted = config.max_running_requests + config.max_queued_requests
    return max(_MIN_PENDING_CALLS, _PENDING_CALLS_PER_ADMITTED * admitted)


def _server_options(config: RouterConfig) -> tuple[tuple[str, int], ...]:
    bound = max_pending_calls(config)
    return (
        ("grpc.server.max_pending_requests", bound),
        ("grpc.server.max_pending_requests_hard_limit", bound),
    )


def _interceptors(config: RouterConfig) -> list[grpc.aio.ServerInterceptor]:
    if config.auth_token is None:
        return []
    open_services: list[str] = []
    if HAS_HEALTH_SERVICES and config.auth_exempt_health:
        open_services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    if HAS_HEALTH_SERVICES and config.auth_exempt_reflection:
        open_services.append(reflection.SERVICE_NAME)
    return [BearerTokenInterceptor(config.auth_token, open_services)]


class Router:
    def __init__(
        self,
        config: RouterConfig,
        prefill_handles: Sequence[PrefillHandle],
        decode_handles: Sequence[DecodeHandle] = (),
    ) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.tokenizer = RouterTokenizer(config.model_dir)
        self.limits = load_model_limits(config.model_dir, config.max_model_len)
        prefix_index = PrefixIndex() if config.prefill_policy == "kv_aware" else None
        self.pool = WorkerPool(config, self.metrics, prefill_handles, decode_handles, prefix_index)
        self.admission = AdmissionController(
            config.max_running_requests, config.max_queued_requests
        )
        dispatcher = Dispatcher(
            self.pool,
            make_prefill_policy(config.prefill_policy, config.block_size, prefix_index),
            make_decode_policy(config.decode_policy, config.block_size),
            config.worker_timeout_s,
            adaptive_placer(config, self.metrics) if self.pool.adaptive else None,
            RequestSLO(config.default_ttft_slo_s, config.default_tpot_slo_s),
        )
        runner = GenerationRunner(
            self.pool,
            dispatcher,
            self.admission,
            self.tokenizer,
            self.metrics,
            config.max_retries,
            config.recovery_wait_s,
        )
        self._validator = RequestValidator(config, self.tokenizer, self.limits)
        self._servicer = GenerationServicer(self._validator, runner, self.metrics)
        self._runner = runner
        self._health = health_aio.HealthServicer() if HAS_HEALTH_SERVICES else None
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._metrics_http: MetricsHttpServer | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.http_app: ASGIApp | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self.pool.start()
        server = grpc.aio.server(
            interceptors=_interceptors(self.config), options=_server_options(self.config)
        )
        server.add_generic_rpc_handlers((self._servicer.rpc_handler(),))
        self._add_health_services(server)
        self.port = self._bind(server)
        await server.start()
        self._server = server
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop())
        if self.config.metrics_port is not None:
            self._start_metrics_http()
        if self.config.http_port is not None:
            await self._start_http()
        logger.info(
            "router listening on %s (metrics port %s, HTTP port %s)",
            self.address,
            self.metrics_port,
            self.http_port,
        )

    def _add_health_services(self, server: grpc.aio.Server) -> None:
        if self._health is None:
            logger.warning("no grpcio-health-checking or grpcio-reflection: no health service")
            return
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )

    def _start_metrics_http(self) -> None:
        config = self.config
        assert config.metrics_port is not None
        public = config.metrics_public
        tls_files = None
        if public and config.tls_cert_file and config.tls_key_file:
            tls_files = (config.tls_cert_file, config.tls_key_file)
        self._metrics_http = MetricsHttpServer.start(
            self.metrics.registry,
            config.metrics_host,
            config.metrics_port,
            token=config.auth_token if public else None,
            tls_files=tls_files,
        )
        self.metrics_port = self._metrics_http.port

    async def _start_http(self) -> None:
        from router.http_api.app import OpenAIFrontDoor, build_app
        from router.http_api.server import HttpServer

        front = OpenAIFrontDoor(
            self.config,
            self.limits,
            self._validator,
            self._runner,
            self.metrics,
            is_serving=lambda: not self._stopping and self.pool.healthy(),
        )
        config = self.config
        self.http_app = build_app(front)  # the ASGI app, for in-process callers (tests)
        self._http = HttpServer(
            self.http_app,
            config.http_host,
            config.http_port or 0,
            config.shutdown_grace_s,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
            header_timeout_s=config.http_header_timeout_s,
            body_timeout_s=config.http_body_timeout_s,
        )
        self.http_port = await self._http.start()

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.uses_tls:
            assert self.config.tls_cert_file and self.config.tls_key_file
            key = Path(self.config.tls_key_file).read_bytes()
            cert = Path(self.config.tls_cert_file).read_bytes()
            credentials = grpc.ssl_server_credentials([(key, cert)])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"the router could not listen on {address}")
        return port

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_refresh_interval_s)
            await self._update_health()

    async def _update_health(self) -> None:
        if self._health is None:
            return
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if self.pool.healthy() else response.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop admitting, give in-flight requests `grace_s` to finish, then cancel them (their
        cleanup aborts them on the workers) and stop the background tasks."""
        self._stopping = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await asyncio.gather(self._stop_grpc(grace), self._stop_http(grace))
        await self.pool.stop()
        self._validator.close()
        if self._metrics_http is not None:
            self._metrics_http.close()
            self._metrics_http = None

    async def _stop_grpc(self, grace_s: float) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def _stop_http(self, grace_s: float) -> None:
        if self._http is not None:
            await self._http.stop(grace_s)
            self._http = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
