"""A small read-only HTTP server: a table of GET routes, each answering (body, content type).

The standard library's threading server is enough for a page polled every few seconds and a Prometheus
scrape; it keeps the monitoring host free of a web framework. Only GET and HEAD exist; anything else is 405,
an unknown path 404, and a route that fails answers 500 without taking the server down.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

log = logging.getLogger(__name__)

Route = Callable[[], tuple[bytes, str]]

ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def asset(name: str) -> Route:
    """A route serving ``peer/observe/static/<name>`` (package data: the page works offline, no CDN)."""
    suffix = name[name.rfind(".") :]
    body = resources.files("peer.observe").joinpath("static", name).read_bytes()
    content_type = ASSET_TYPES[suffix]
    return lambda: (body, content_type)


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, Route] = {}
    server_version = "tasklet-observe"

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


class ObserveServer:
    """Serve ``routes`` on ``host:port`` (0: a free port) from a background thread until :meth:`close`."""

    def __init__(self, host: str, port: int, routes: dict[str, Route]) -> None:
        handler = type("Handler", (_Handler,), {"routes": dict(routes)})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
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
