"""The multi-host test bed itself: addresses, NAT, port forwarding, shaping and teardown are what they claim."""

from __future__ import annotations

import os
import subprocess

import pytest

from tasklet.peer.emulation.netbed import (
    PREFIX,
    NetBed,
    can_connect,
    cleanup_stale,
    list_namespaces,
    measure_throughput,
    port_forwarded,
    three_public,
    two_public_two_home,
    unavailable_reason,
    wait_ready,
)

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(60)]
PORT = 5100


def test_public_hosts_reach_each_other_by_address(bed: NetBed) -> None:
    hosts = three_public(bed)
    assert len({h.addr for h in hosts}) == 3
    for host in hosts:
        wait_ready(host.tool_popen("serve", str(PORT)))
    for src in hosts:
        for dst in hosts:
            if src is not dst:
                ok, seen = can_connect(src, dst.addr, PORT)
                assert ok, f"{src.name} -> {dst.name}: {seen}"
                assert seen == src.addr


def test_home_hosts_dial_out_but_nobody_dials_in(bed: NetBed) -> None:
    (pub0, pub1), (home0, home1) = two_public_two_home(bed)
    for host in (pub0, home0, home1):
        wait_ready(host.tool_popen("serve", str(PORT)))
    # Out through the NAT: the public host sees the router's address, not the home LAN address.
    ok, seen = can_connect(home0, pub0.addr, PORT)
    assert ok, seen
    assert seen == home0.router.addr != home0.local_addr
    # In: neither the router's public address nor the LAN address leads to the home host.
    for dst_addr in (home0.addr, home0.local_addr):
        ok, err = can_connect(pub1, dst_addr, PORT)
        assert not ok, f"public host reached home host at {dst_addr}"
        assert err
    # Home to home: not directly, not via the other router's address.
    for dst_addr in (home1.addr, home1.local_addr):
        ok, _ = can_connect(home0, dst_addr, PORT)
        assert not ok, f"home0 reached home1 at {dst_addr}"


def test_forwarded_ports_reach_the_home_host(bed: NetBed) -> None:
    pub, home = port_forwarded(bed, ports=(PORT, PORT + 1))
    for port in (PORT, PORT + 1, PORT + 2):
        wait_ready(home.tool_popen("serve", str(port)))
    for port in (PORT, PORT + 1):
        ok, seen = can_connect(pub, home.addr, port)
        assert ok, f"forwarded port {port}: {seen}"
        assert seen == pub.addr  # DNAT only: the home host sees the real client
    ok, _ = can_connect(pub, home.addr, PORT + 2)
    assert not ok, "a port that is not forwarded reached the home host"


@pytest.mark.parametrize("kind", ["tbf", "htb"])
def test_shaping_limits_tcp_throughput(bed: NetBed, kind: str) -> None:
    src, dst, _ = three_public(bed)
    bed.shape(src, 100, kind=kind)
    mbit = measure_throughput(src, dst, seconds=2.0)
    print(f"{kind} 100 Mbit/s link: measured {mbit:.1f} Mbit/s")
    assert 85 <= mbit <= 115, f"{kind}: {mbit:.1f} Mbit/s on a 100 Mbit/s link"


def test_teardown_leaves_nothing_behind() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetBed() as bed:
        two_public_two_home(bed)
        server = bed.hosts["home0"].tool_popen("serve", str(PORT))
        wait_ready(server)
        made = list(bed.namespaces)
        assert made and all(ns in list_namespaces() for ns in made)
    assert server.poll() is not None, "a process started in the bed outlived it"
    assert not [ns for ns in list_namespaces() if ns.startswith(bed.tag)]
    # Nothing of ours in the root namespace: the bed's veths lived and died in its namespaces.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "p-pub" not in links and "r-home" not in links and "lan0" not in links


def test_cleanup_removes_namespaces_of_dead_runs_only() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, ours = f"{PREFIX}-{dead.pid}-dead-x", f"{PREFIX}-{os.getpid()}-live-x"
    for ns in (stale, ours):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed and stale not in list_namespaces()
        assert ours in list_namespaces(), "cleanup removed the namespace of a live run"
    finally:
        for ns in (stale, ours):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_teardown_after_a_failing_test_body() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    tag = ""
    with pytest.raises(KeyboardInterrupt), NetBed() as bed:
        tag = bed.tag
        three_public(bed)
        bed.hosts["pub0"].tool_popen("serve", str(PORT))
        raise KeyboardInterrupt
    assert tag and not [ns for ns in list_namespaces() if ns.startswith(tag)]
