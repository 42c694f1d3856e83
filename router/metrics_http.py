"""The metrics port: the router's Prometheus registry over HTTP, on a thread of its own.

    server = MetricsHttpServer.start(registry, host, port, token=..., tls_files=...)
    server.port        # the bound port (port 0: a free one)
    server.close()

prometheus_client's start_http_server has no authentication, so this serves the same WSGI app
(`make_wsgi_app`) behind the router's bearer-token check when a token is given, and over TLS
when certificate files are. Which ones apply is the router's rule (RouterConfig): both on a
public address, neither on loopback. Scrapes run on this server's threads, off the event loop.
"""

from __future__ import annotations

import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from router.auth import bearer_token_wsgi


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # one line on stderr per scrape is noise


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scrape must not keep the process alive


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class MetricsHttpServer:
    def __init__(self, server: WSGIServer) -> None:
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(
        cls,
        registry: CollectorRegistry,
        host: str,
        port: int,
        token: str | None = None,
        tls_files: tuple[str, str] | None = None,
    ) -> MetricsHttpServer:
        """Bind and serve; `tls_files` is (certificate, key)."""
        app = make_wsgi_app(registry)
        if token is not None:
            app = bearer_token_wsgi(app, token)
        server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
        server = make_server(host.strip("[]"), port, app, server_class, _QuietHandler)
        if tls_files is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*tls_files)
            # The handshake happens on the request's own thread, at its first read: done in
            # accept(), one client that connects and stays silent would block every scrape.
            server.socket = context.wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False
            )
        return cls(server)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
