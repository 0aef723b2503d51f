"""Configuration shared by the transport's server and client (see peer.net)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tasklet.peer.net.limits import descriptor_budget
from tasklet.peer.net.tls import TlsContext, process_tls

MIB = 1 << 20
# The longest deadline a peer's server accepts: above every call timeout of peer.timing (a step's 600 s).
MAX_CALL_S = 600.0
HANDSHAKE_TIMEOUT_S = 20.0
GRPC_DESCRIPTOR_SHARE = 0.3  # of the process's descriptor budget (peer.net.limits) its gRPC port may hold at most
FRONT_DESCRIPTORS = 3  # one connection through the gRPC front (peer.net.front) holds: outside, inside, gRPC's end
SOURCE_SHARE = 0.75  # of a port's connections, one source address may hold at most this share
MAX_STREAMS_PER_CONNECTION = 128  # HTTP/2 streams one connection may open at once (the slots refuse most anyway)
# Room for a Chunk's own fields and gRPC framing around a payload of chunk_bytes.
CHUNK_OVERHEAD_BYTES = 1024


@dataclass(frozen=True)
class TransportConfig:
    """Limits and sizes of one peer's gRPC transport.

    host, port: where the server listens (port 0: let the OS pick; PeerServer.start returns it).
    max_message_bytes: the gRPC per-message limit, both directions (one Chunk must fit).
    max_envelope_bytes: the largest reassembled Envelope the server accepts (and the client accepts from a
        Fetch); larger ones are refused from the first chunk, before anything is buffered.
    chunk_bytes: payload per Chunk when sending (a shaped link may use smaller ones, see LinkShaper).
    max_concurrent_streams: streaming calls (Push, Fetch, Probe) served at once; more are refused with
        UNAVAILABLE ("busy") instead of queueing behind them.
    thread_pool_size: server worker threads; must exceed max_concurrent_streams so that unary calls (Ping,
        Status) always find a thread while every stream slot is taken.
    max_inflight_pushes: client-side backpressure; a push blocks while this many are unfinished.
    default_timeout_s: the deadline of a call whose caller gives none (there is never a call without one).
    max_streams_per_peer: streaming calls one authenticated peer may have in progress at once (the rest of
        the slots stay free for the others); more are refused with RESOURCE_EXHAUSTED.
    max_deadline_s: calls asking for a longer deadline are refused: no caller can pin a stream slot and its
        buffer for longer than this.
    bulk_port: the port of the bulk lane (peer.net.bulk_wire: large pushes over a socket of their own, beside gRPC,
        with the same checks): 0 lets the OS pick one (peers learn it over gRPC), None turns the lane off (this
        server has none and this client's pushes all go through gRPC). Behind a firewall that opens only
        ``port``, clients fall back to gRPC by themselves.
    bulk_min_bytes: pushes of at least this many serialized bytes take the bulk lane, smaller ones gRPC (the lane's
        gain is in the copies of large tensors; small messages keep gRPC's latency path).
    stream_idle_s: a streaming call whose bytes did not move for this long (no chunk received, none taken by
        the caller) is cancelled, whatever its deadline: an idle caller holds no stream slot for long.
    max_connections: connections the gRPC port holds at once, ``SOURCE_SHARE`` of them from one source address
        (more are closed before their handshake); None: a share of this process's descriptor budget
        (peer.net.limits.descriptor_budget).
    front: put the port's front door (peer.net.front) before gRPC, which is what enforces the per-source cap;
        False leaves only gRPC's own total cap (benchmark baselines).
    tls: this peer's key, certificate and trust store (peer.net.tls); mutual TLS on every connection, each
        call's caller authenticated by its certificate. The default is the process's own ephemeral identity
        (peer.net.tls.process_tls). None: plaintext and unauthenticated, only for benchmark baselines.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 8 * MIB
    max_envelope_bytes: int = 1024 * MIB
    chunk_bytes: int = 1 * MIB
    max_concurrent_streams: int = 8
    thread_pool_size: int = 12
    max_inflight_pushes: int = 4
    default_timeout_s: float = 30.0
    max_streams_per_peer: int | None = None  # None: max_concurrent_streams
    max_deadline_s: float = MAX_CALL_S
    bulk_port: int | None = 0
    bulk_min_bytes: int = 256 << 10
    tls: TlsContext | None = field(default_factory=process_tls)
    max_connections: int | None = None
    stream_idle_s: float = 60.0
    front: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be None or in [0, 65535], got {self.bulk_port}")
        if self.bulk_min_bytes < 0:
            raise ValueError(f"bulk_min_bytes must be >= 0, got {self.bulk_min_bytes}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.chunk_bytes + CHUNK_OVERHEAD_BYTES > self.max_message_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) plus {CHUNK_OVERHEAD_BYTES} bytes of framing must fit in "
                f"max_message_bytes ({self.max_message_bytes})"
            )
        if self.max_envelope_bytes <= 0:
            raise ValueError(f"max_envelope_bytes must be positive, got {self.max_envelope_bytes}")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
        if self.thread_pool_size < self.max_concurrent_streams + 2:
            raise ValueError(
                f"thread_pool_size ({self.thread_pool_size}) must be at least max_concurrent_streams + 2 "
                f"({self.max_concurrent_streams + 2}) so that Ping and Status are served while streams run"
            )
        if self.max_inflight_pushes < 1:
            raise ValueError(f"max_inflight_pushes must be >= 1, got {self.max_inflight_pushes}")
        if not self.default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be positive, got {self.default_timeout_s}")
        if self.max_streams_per_peer is not None and self.max_streams_per_peer < 1:
            raise ValueError(f"max_streams_per_peer must be >= 1, got {self.max_streams_per_peer}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be None or >= 1, got {self.max_connections}")
        if not self.stream_idle_s > 0:
            raise ValueError(f"stream_idle_s must be positive, got {self.stream_idle_s}")
        if not self.max_deadline_s > 0:
            raise ValueError(f"max_deadline_s must be positive, got {self.max_deadline_s}")

    @property
    def streams_per_peer(self) -> int:
        return self.max_concurrent_streams if self.max_streams_per_peer is None else self.max_streams_per_peer

    @property
    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # a connection that has not finished its TLS handshake by then is dropped (servers only)
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            # a cap on the port's connections, so that a flood cannot take the descriptors the peer needs (servers)
            ("grpc.max_allowed_incoming_connections", self.connection_cap),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ]

    @property
    def connection_cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return max(16, int(descriptor_budget() * GRPC_DESCRIPTOR_SHARE) // FRONT_DESCRIPTORS)

    @property
    def connections_per_source(self) -> int:
        return max(1, int(self.connection_cap * SOURCE_SHARE))
