"""The swarm dashboard: a page at ``/``, the same data as JSON at ``/api/swarm``, served from package data.

`peer dashboard --dht ADDR` runs one as a read-only DHT client (like `peer status`); a daemon started with
``--dashboard-port`` serves the same page from its own view of the swarm. The page (``static/``) polls
``/api/swarm`` and draws everything itself with plain DOM and SVG: no CDN, no framework, so it works on a
monitoring host without internet. Every string from the swarm reaches the page as text, never as markup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tasklet.peer.observe.http import ObserveServer, Route, asset
from tasklet.peer.observe.snapshot import SwarmSource, build_snapshot
from tasklet.peer.observe.watch import SwarmWatcher

log = logging.getLogger(__name__)

PAGE_ASSETS = ("index.html", "dashboard.js", "dashboard.css")


def dashboard_routes(watcher: SwarmWatcher) -> dict[str, Route]:
    """``/``, the page's assets and ``/api/swarm``."""
    routes = {f"/{name}": asset(name) for name in PAGE_ASSETS}
    routes["/"] = routes["/index.html"]
    routes["/api/swarm"] = lambda: (watcher.json_bytes(), "application/json")
    return routes


class Dashboard:
    """A :class:`SwarmWatcher` over ``source`` and an HTTP server for it; ``close()`` stops both."""

    def __init__(
        self,
        source: SwarmSource,
        run_id: str,
        host: str,
        port: int,
        interval_s: float = 2.0,
        extra_routes: dict[str, Route] | None = None,
    ) -> None:
        self.watcher = SwarmWatcher(lambda: build_snapshot(source, run_id), interval_s)
        self.server = ObserveServer(host, port, {**dashboard_routes(self.watcher), **(extra_routes or {})})
        self.watcher.start()

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.close()
        self.watcher.close()


def serve_dashboard(
    dht_peers: list[str],
    run_id: str,
    secret: str | None,
    host: str,
    port: int,
    *,
    interval_s: float = 2.0,
    stop: threading.Event | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """`peer dashboard`: bind the port first (a port in use fails at once), join the DHT, serve until ``stop``.

    Raises OSError (the port) or ``peer.swarm.dht.DHTStartError`` (the DHT), each with a one-line message.
    """
    from tasklet.peer.swarm.status import StatusReader

    stop = stop or threading.Event()
    sources: list[SwarmSource] = []  # filled once the DHT is up; the watcher only reads after that
    watcher = SwarmWatcher(lambda: build_snapshot(sources[0], run_id), interval_s)
    server = ObserveServer(host, port, dashboard_routes(watcher))
    try:
        with StatusReader(dht_peers, run_id, secret) as reader:
            sources.append(SwarmSource.from_reader(reader))
            try:
                first = watcher.poll()
            except Exception as exc:  # recorded by the watcher; the page shows it and the loop retries
                first = {}
                log.warning("first read of the swarm failed: %s", exc)
            watcher.start()
            say(f"dashboard of run {run_id!r} at {server.url} (JSON at {server.url}api/swarm); Ctrl-C to stop")
            if not first.get("peers") and not (first.get("plan") or {}).get("epoch"):
                log.warning("no run named %r is visible in this DHT yet (wrong --run or --secret?); "
                            "the page will show it when it appears", run_id)
            try:
                stop.wait()
            finally:
                watcher.close()
    finally:
        server.close()
