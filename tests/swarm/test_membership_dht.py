"""Starting and joining the DHT: bad addresses and busy ports end fast with a one-line error."""

from __future__ import annotations

import socket
import time

import pytest

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.dht import DHTConfig, DHTStartError, start_dht, visible_maddrs

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

UNUSED_PEER = "12D3KooWJnQD5YpLDToANAY4CPf2P7TNWyPce4jCFXKo28fYWWGw"
# one DHT process or two, no swarm: lane 1 (tests/conftest.py); the unreachable address's 8 s wait under a 10 s
# bound stays in lane 2 (in lane 1 it would run beside lane 2's swarms)
LIGHT = pytest.mark.light_processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (f"/ip4/127.0.0.1/tcp/{{port}}/p2p/{UNUSED_PEER}", "cannot join the DHT at"),
        pytest.param("garbage", "bad --dht address", marks=LIGHT),
        pytest.param("/ip4/127.0.0.1/tcp/{port}", "bad --dht address", marks=LIGHT),
    ],
)
def test_bad_dht_address_fails_fast_and_clearly(address, message):
    address = address.format(port=free_port())  # nothing listens there
    start = time.monotonic()
    with pytest.raises(DHTStartError) as error:
        start_dht(DHTConfig(initial_peers=(address,), startup_timeout_s=8.0), Identity.generate())
    assert time.monotonic() - start < 10
    text = str(error.value)
    assert message in text and "\n" not in text
    assert not text.startswith("Daemon failed")


@LIGHT
def test_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DHTStartError, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
            start_dht(DHTConfig(port=port), Identity.generate())


@LIGHT
@pytest.mark.parametrize(
    ("config", "message"),
    [(DHTConfig(host="not-an-ip"), "host must be an IP address"), (DHTConfig(port=70000), "port must be")],
)
def test_bad_listen_address(config, message):
    with pytest.raises(DHTStartError, match=message):
        start_dht(config, Identity.generate())


@LIGHT
def test_join_through_a_fixed_port_and_client_mode():
    port = free_port()
    first = start_dht(DHTConfig(port=port), Identity.generate())
    try:
        maddrs = visible_maddrs(first)
        assert any(f"/tcp/{port}/p2p/" in maddr for maddr in maddrs)
        client = start_dht(DHTConfig(initial_peers=tuple(maddrs), client_mode=True), Identity.generate())
        try:
            assert client.client_mode and not first.client_mode
        finally:
            client.shutdown()
    finally:
        first.shutdown()
