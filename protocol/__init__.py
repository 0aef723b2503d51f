"""Tasklet's wire protocol: the `.proto` messages, their generated stubs, tensor (de)serialisation with
optional compression, chunking of large messages, and the protocol version every message carries.

This package imports nothing else of Tasklet's, so any process (daemon, tests, benchmarks) can speak the
protocol without pulling in the runtime.
"""

PROTOCOL_VERSION: int = 5
"""Bumped on any change to the wire format that an older peer would misread. Peers refuse messages of any
other version (see peer.net), so mixed-version swarms fail loudly instead of corrupting training. Version 3: the
parameters hash replicas report is BLAKE3 (peer.compute.stage.bytes_digest), which a version-2 peer computes
with sha256. Version 5 (4 was a change taken back): ``start_step`` carries the leader's signed step record, which
a worker keeps and shows in its status (peer.node.step_record); a version-3 worker would drop it, and a new
leader would then bound its claims by the DHT's progress record alone, stored at most once a second, and judge
it a liar."""

SPARSE_COMPRESSIONS: tuple[str, ...] = ("topk", "topk2", "topk4")
"""The codecs that send a tensor's largest entries only (protocol.lowbit, protocol.sparse): a sender keeps what
they leave out as an error-feedback residual, and a sum of such tensors is itself sparse."""

__all__ = ["PROTOCOL_VERSION", "SPARSE_COMPRESSIONS"]
