"""Tasklet's gRPC transport: chunked Envelope streams with deadlines, limits, backpressure and link emulation.

One import point for the runtime:

    from peer.transport import PeerServer, PeerClient, TransportConfig, LinkShaper

* `PeerServer(config)`: `register_push(kind, handler)`, `register_fetch(kind, handler)`,
  `set_status_provider(fn)`, `set_reply_shaper(lookup)`, `start() -> port`, `stop(grace)`. Checks protocol
  version, chunk order and sizes before any handler runs; handlers run on server threads and refuse bad
  content by raising protocol.errors.BadMessage / Rejected / Unavailable (see peer.transport_server).
* `PeerClient(endpoint, config, shaper=..., sender=...)`: `push`, `push_async`, `fetch`, `ping`, `probe`,
  `status`, `close`; every call has a deadline; errors are protocol.errors.Refused / PeerUnreachable
  (see peer.transport_client).
* `LinkShaper(rate_bps, delay_s)`, `LinkTable(link_of)`: sender-side emulation of a link (peer.shaping).
"""

from peer.shaping import LinkShaper, LinkTable
from peer.transport_client import PeerClient, map_rpc_error
from peer.transport_config import TransportConfig
from peer.transport_server import PeerServer, kind_value

__all__ = [
    "LinkShaper",
    "LinkTable",
    "PeerClient",
    "PeerServer",
    "TransportConfig",
    "kind_value",
    "map_rpc_error",
]
