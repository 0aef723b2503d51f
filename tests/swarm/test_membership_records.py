"""Schema checks of adverts and link reports, identity files, and the join-secret MAC (no DHT needed)."""

from __future__ import annotations

import os
import stat

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity, peer_id_from_public_key, split_owner_subkey
from tasklet.peer.swarm.adverts import PROTOCOL_VERSION, Advert, LinkReport, check_endpoint
from tasklet.peer.swarm.records import MacStatus, RecordStore, canonical_json

DEVICE = DeviceInfo("RTX 4090", "cuda", 24 * 2**30, 82.5, True, False)


def advert_record(**changes) -> dict:
    record = Advert("abc123", "127.0.0.1:5000", DEVICE, 1000.0, extra={"stage": 1}).to_record()
    record.update(changes)
    return record


def test_advert_round_trip_and_protocol_version():
    advert = Advert("abc123", "127.0.0.1:5000", DEVICE, 1000.0, role="client", corpus="c1", extra={"a": [1]})
    again = Advert.from_record(advert.to_record())
    assert again == advert
    assert again.protocol_version == PROTOCOL_VERSION >= 1


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"peer_id": ""}, "advert.peer_id"),
        ({"peer_id": "a b"}, "advert.peer_id"),
        ({"endpoint": "127.0.0.1"}, "advert.endpoint"),
        ({"endpoint": "127.0.0.1:0"}, "advert.endpoint"),
        ({"endpoint": "bad host!:80"}, "advert.endpoint"),
        ({"started_at": float("nan")}, "advert.started_at"),
        ({"started_at": True}, "advert.started_at"),
        ({"protocol_version": "1"}, "advert.protocol_version"),
        ({"role": "boss"}, "advert.role"),
        ({"corpus": "x" * 500}, "advert.corpus"),
        ({"extra": {"blob": "x" * 5000}}, "advert.extra"),
        ({"extra": {"nan": float("inf")}}, "advert.extra"),
        ({"extra": []}, "advert.extra"),
        ({"surprise": 1}, "advert.surprise"),
        ({"device": {**DEVICE.to_dict(), "tflops": -1.0}}, "advert.device.tflops"),
        ({"device": {**DEVICE.to_dict(), "tflops": "fast"}}, "advert.device.tflops"),
        ({"device": {**DEVICE.to_dict(), "kind": "tpu"}}, "advert.device.kind"),
        ({"device": {**DEVICE.to_dict(), "memory_bytes": 1.5}}, "advert.device.memory_bytes"),
        ({"device": {**DEVICE.to_dict(), "measured": 1}}, "advert.device.measured"),
        ({"device": "gpu"}, "advert.device"),
    ],
)
def test_bad_advert_field_is_named(changes, field):
    with pytest.raises(ValueError) as error:
        Advert.from_record(advert_record(**changes))
    assert str(error.value).startswith(field), str(error.value)


def test_missing_field_and_non_dict_are_refused():
    record = advert_record()
    del record["endpoint"]
    with pytest.raises(ValueError, match=r"advert\.endpoint: missing"):
        Advert.from_record(record)
    with pytest.raises(ValueError, match="expected a dict"):
        Advert.from_record(["not", "a", "dict"])


def test_constructing_a_bad_advert_fails_too():
    with pytest.raises(ValueError, match="advert.endpoint"):
        Advert("abc", "nowhere", DEVICE, 0.0)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:1", "[::1]:5000", "peer-3.example.org:65535", "local:80"])
def test_good_endpoints(endpoint):
    assert check_endpoint(endpoint) == endpoint


def test_link_report_checks():
    report = LinkReport("a", "b", 0.05, 1.25e8, True, 10.0)
    assert LinkReport.from_record(report.to_record()) == report
    for changes, field in [
        ({"dst": "a"}, "link.dst"),
        ({"rtt_s": -0.1}, "link.rtt_s"),
        ({"bandwidth_bps": float("inf")}, "link.bandwidth_bps"),
        ({"measured": "yes"}, "link.measured"),
    ]:
        with pytest.raises(ValueError) as error:
            LinkReport.from_record({**report.to_record(), **changes})
        assert str(error.value).startswith(field)


def test_identity_file_round_trip(tmp_path):
    path = tmp_path / "keys" / "tasklet.peer.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = Identity.load_or_create(path)
    assert second.peer_id == first.peer_id
    assert second.public_key == first.public_key
    assert Identity.generate().peer_id != first.peer_id
    with pytest.raises(ValueError, match="already exists"):
        first.save(path)


def test_identity_file_errors_are_one_line(tmp_path):
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a DER-encoded RSA private key"):
        Identity.load(garbage)
    with pytest.raises(ValueError, match="cannot read it"):
        Identity.load(tmp_path)  # a directory


def test_peer_id_comes_from_the_owner_tag():
    identity = Identity.generate()
    parsed = split_owner_subkey(identity.owner_tag + b"|epoch=7")
    assert parsed == (identity.peer_id, b"|epoch=7")
    assert identity.peer_id == peer_id_from_public_key(identity.public_key)
    assert split_owner_subkey(b"no tag here") is None
    assert split_owner_subkey("a string") is None


def test_mac_binds_secret_key_name_writer_expiry_and_payload():
    identity = Identity.generate()
    store = RecordStore(None, "run", identity, "secret")  # type: ignore[arg-type]  # no DHT calls here
    payload = {"b": 1, "a": [1.5, None, True]}
    me, other_peer, expiry = identity.peer_id, "0123456789abcdef0123", 1234.5
    mac = store.mac("peers", me, b"", expiry, payload)
    check = store._check_mac
    assert check("peers", me, b"", expiry, {"a": [1.5, None, True], "b": 1}, mac) is MacStatus.OK
    assert check("links", me, b"", expiry, payload, mac) is MacStatus.BAD  # another key
    assert check("peers", other_peer, b"", expiry, payload, mac) is MacStatus.BAD  # replayed by another writer
    assert check("peers", me, b"", expiry + 60, payload, mac) is MacStatus.BAD  # replayed with a new expiry
    assert check("peers", me, b"|x", expiry, payload, mac) is MacStatus.BAD  # another suffix
    assert check("peers", me, b"", expiry, {**payload, "b": 2}, mac) is MacStatus.BAD
    assert check("peers", me, b"", expiry, payload, None) is MacStatus.MISSING
    other = RecordStore(None, "run", identity, "another")  # type: ignore[arg-type]
    assert other._check_mac("peers", me, b"", expiry, payload, mac) is MacStatus.BAD
    other_run = RecordStore(None, "run2", identity, "secret")  # type: ignore[arg-type]
    assert other_run._check_mac("peers", me, b"", expiry, payload, mac) is MacStatus.BAD
    open_store = RecordStore(None, "run", identity, None)  # type: ignore[arg-type]
    assert open_store._check_mac("peers", me, b"", expiry, payload, mac) is MacStatus.BAD
    assert open_store._check_mac("peers", me, b"", expiry, payload, None) is MacStatus.OK
    assert "secret" not in repr(store) and "secret" not in repr(vars(store))  # only a derived key is kept


def test_canonical_json_refuses_non_json():
    assert canonical_json({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    for bad in ({"x": float("nan")}, {"x": b"bytes"}, {"x": {1, 2}}):
        with pytest.raises(ValueError):
            canonical_json(bad)
