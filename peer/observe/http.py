"""A small read-only HTTP server: a table of GET routes, each answering (body, content type).

The standard library's threading server is enough for a page polled every few seconds and a Prometheus
scrape; it keeps the monitoring host free of a web framework. Only GET and HEAD exist; anything else is 405,
an unknown path 404, and a route that fails answers 500 without taking the server down.

Whoever can reach the port can open connections, so the server holds at most :data:`MAX_CONNECTIONS` at once
(:data:`MAX_PER_SOURCE` from one address; more are closed before a byte is read), every read waits at most
:data:`READ_TIMEOUT_S`, and a connection is cut :data:`REQUEST_DEADLINE_S` after it was accepted however
slowly its bytes come: a flood of idle or trickling sockets costs a bounded number of descriptors and threads.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from tasklet.peer.net.limits import ConnectionCap

log = logging.getLogger(__name__)

Route = Callable[[], tuple[bytes, str]]
MAX_CONNECTIONS = 64
MAX_PER_SOURCE = 16
READ_TIMEOUT_S = 10.0
REQUEST_DEADLINE_S = 30.0

ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def asset(name: str) -> Route:
    """A route serving ``peer/observe/static/<name>`` (package data: the page works offline, no CDN)."""
    suffix = name[name.rfind(".") :]
    body = resources.files("tasklet.peer.observe").joinpath("static", name).read_bytes()
    content_type = ASSET_TYPES[suffix]
    return lambda: (body, content_type)


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, Route] = {}
    server_version = "tasklet-observe"
    timeout = READ_TIMEOUT_S  # every read of the request (socketserver sets it on the connection)
    protocol_version = "HTTP/1.0"  # one request per connection: nothing is kept open between polls

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        route = self.routes.get(path)
        if route is None:
            self._send(404, b"not found\n", "text/plain; charset=utf-8", send_body)
            return
        try:
            body, content_type = route()
        except Exception as exc:
            log.exception("GET %s failed", path)
            self._send(500, f"error: {type(exc).__name__}\n".encode(), "text/plain; charset=utf-8", send_body)
            return
        self._send(200, body, content_type, send_body)

    def _send(self, code: int, body: bytes, content_type: str, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self._answer(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(False)

    def _refuse(self) -> None:
        self._send(405, b"read-only\n", "text/plain; charset=utf-8", True)

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's signature
        log.debug("%s %s", self.address_string(), format % args)


class _CappedServer(ThreadingHTTPServer):
    """A threading HTTP server that admits connections through a ConnectionCap and cuts each one at a deadline."""

    daemon_threads = True
    cap = ConnectionCap(MAX_CONNECTIONS, MAX_PER_SOURCE)  # replaced per server in ObserveServer

    def verify_request(self, request: object, client_address: object) -> bool:
        return self.cap.admit(_source(client_address))

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        timer = threading.Timer(REQUEST_DEADLINE_S, _cut, args=(request,))
        timer.daemon = True
        timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            timer.cancel()
            self.cap.release(_source(client_address))

    def process_request(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread to be had: refuse this connection, keep serving
            self.cap.release(_source(client_address))
            self.shutdown_request(request)


def _source(client_address: object) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else "?"


def _cut(sock: socket.socket) -> None:
    """End a connection past its deadline: the handler's blocked read returns and its thread ends."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ObserveServer:
    """Serve ``routes`` on ``host:port`` (0: a free port) from a background thread until :meth:`close`."""

    def __init__(self, host: str, port: int, routes: dict[str, Route], max_connections: int = MAX_CONNECTIONS,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        handler = type("Handler", (_Handler,), {"routes": dict(routes)})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.cap = ConnectionCap(max_connections, max_per_source)
        server_cls = type("Server", (_CappedServer,), {"address_family": family, "cap": self.cap})
        try:
            self._httpd = server_cls((host, port), handler)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"http-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
