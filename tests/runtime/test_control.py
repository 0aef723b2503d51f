"""Every control operation survives the wire as the .proto's Control, and each channel takes only its own."""

from __future__ import annotations

import pytest

from tasklet.peer.runtime import control as ctl
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage

MESSAGES = [ctl.Stop(), ctl.StartStep(3, 1, True), ctl.DropStep(2), ctl.Reduce(4, 2, (0, 1), {0: 1, 5: 0}, True),
            ctl.Reduce(4, 3, (1,), {2: 1}, apply=True),
            ctl.Apply(1, True), ctl.Resync(1, 2, "h:1"), ctl.Loss(1, 2, 3.5), ctl.Reduced(1, 2),
            ctl.Synced(1, 2, "ab"), ctl.TaskError("forward", 1, "x"), ctl.PeerError("h:2", "x"),
            ctl.BadPeer(1, 0, "s", "e")]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.op.value)
def test_every_operation_round_trips_through_the_wire(msg: ctl.Message) -> None:
    received = pb.Envelope.FromString(ctl.encode(msg, "run", 1, 3, stage=0, replica=1).to_pb().SerializeToString())
    assert received.kind == pb.CONTROL
    assert ctl.decode(received, ctl.TO_WORKER | ctl.REPORTS) == msg
    other = ctl.REPORTS if msg.op in ctl.TO_WORKER else ctl.TO_WORKER
    with pytest.raises(BadMessage, match="not accepted here"):
        ctl.decode(received, other)


def test_strings_are_bounded_and_pool_replies_carry_status_and_speculation() -> None:
    long = ctl.encode(ctl.TaskError("w" * 100, 0, "e" * 5000), "run", 1).to_pb()
    got = ctl.decode(pb.Envelope.FromString(long.SerializeToString()), ctl.REPORTS)
    assert isinstance(got, ctl.TaskError) and len(got.what) == 32 and len(got.error) == ctl.MAX_TEXT
    reply = ctl.pool_reply(pb.LEASE, pb.Key(step=1), ctl.PoolStatus.LEASE, speculative=True)
    assert ctl.pool_status(reply) is ctl.PoolStatus.LEASE and ctl.is_speculative(reply)
    assert ctl.pool_status(pb.Envelope()) is None
    assert ctl.op_of(pb.FetchRequest(kind=pb.COMMIT), ctl.POOL_OPS) is ctl.Op.COMMIT
    with pytest.raises(BadMessage):
        ctl.op_of(pb.FetchRequest(kind=pb.OTHER), ctl.POOL_OPS)
