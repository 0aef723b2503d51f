"""The checked-in gRPC stubs match tasklet.proto, and import as part of the `protocol` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("tasklet_pb2.py", "tasklet_pb2.pyi", "tasklet_pb2_grpc.py")


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
def test_checked_in_stubs_are_fresh(tmp_path: Path, processes: None) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    stale = [
        name for name in STUBS if (tmp_path / name).read_bytes() != (ROOT / "protocol" / name).read_bytes()
    ]
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py` and commit the result"


def test_grpc_stub_imports_from_the_package() -> None:
    from tasklet.protocol import tasklet_pb2_grpc

    text = (ROOT / "protocol" / "tasklet_pb2_grpc.py").read_text()
    assert "from tasklet.protocol import tasklet_pb2 as tasklet__pb2" in text
    assert tasklet_pb2_grpc.tasklet__pb2 is pb


def test_service_and_version_fields() -> None:
    service = pb.DESCRIPTOR.services_by_name["Peer"]
    assert service.full_name == "tasklet.v1.Peer"
    assert [m.name for m in service.methods] == ["Push", "Fetch", "Ping", "Probe", "Status", "BulkLane"]
    # Every request and reply message (and Envelope/Chunk) carries the protocol version as field 1.
    for name in (
        "Envelope",
        "Chunk",
        "Ack",
        "FetchRequest",
        "PingRequest",
        "PingReply",
        "ProbeChunk",
        "ProbeReply",
        "StatusRequest",
        "StatusReply",
    ):
        field = pb.DESCRIPTOR.message_types_by_name[name].fields_by_name["protocol_version"]
        assert field.number == 1, name
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1
