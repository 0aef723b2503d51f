"""Tasklet's gRPC transport: chunked Envelope streams with deadlines, limits, backpressure and link emulation.

No facade: callers import the module that holds what they use.

* ``server.PeerServer(config)``: `register_push(kind, handler)`, `register_fetch(kind, handler)`,
  `set_status_provider(fn)`, `set_reply_shaper(lookup)`, `start() -> port`, `stop(grace)`. Checks protocol
  version, chunk order and sizes before any handler runs; handlers run on server threads and refuse bad
  content by raising protocol.errors.BadMessage / Rejected / Unavailable.
* ``client.PeerClient(endpoint, config, shaper=..., sender=...)``: `push`, `push_async`, `fetch`, `ping`, `probe`,
  `status`, `close`; every call has a deadline; errors are protocol.errors.Refused / PeerUnreachable.
* ``config.TransportConfig``: sizes, deadlines and the TLS context of a server or client.
* ``tls.TlsContext``: a peer's identity-bound certificate (``peer.identity.certs``) and trust store; every server and
  client speaks mutual TLS with `TransportConfig.tls` (default: the process's own identity; None only for
  plaintext benchmark baselines), and the server hands handlers the caller's authenticated peer id as the sender.
* The bulk lane (``bulk_wire``, ``bulk_server``, ``bulk_client``): pushes of at least
  `TransportConfig.bulk_min_bytes` go to a peer's lane, a socket beside its gRPC port (mutual TLS, the same
  checks, the tensors sent from their own memory), when the endpoint is direct; the client asks for the port over
  gRPC and falls back to gRPC when the lane is out of reach.
* ``shaping.LinkShaper(rate_bps, delay_s)``, ``shaping.LinkTable(link_of)``: sender-side emulation of a link.
"""
