"""Multi-host test bed from real Linux network namespaces, for tests that need more than loopback.

Every host is its own namespace with its own address; public hosts hang on a Linux bridge that lives in a
dedicated "switch" namespace, so nothing of ours appears in the root namespace and no route leads outside
the bed. "Home" hosts sit behind a router namespace that masquerades them with nftables (no port
forwarding unless asked), like a volunteer's home router. Links can be shaped with tbf or htb (netem is
not available on every kernel, and these tbf/htb cannot add delay).

Names carry the creating process id, so parallel runs never collide and ``cleanup_stale()`` can remove what
a killed run left behind. ``NetBed.close()`` kills every process started in the bed's namespaces (also the
ones they forked) and deletes the namespaces, which takes their veths with them.

The module is also a tiny network tool run *inside* a namespace (``python netbed.py serve|connect|sink|
source|rtt ...``) so tests measure with real sockets and no extra binaries.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "tnb"  # every namespace of the bed starts with "tnb-<pid>-"
TOOL = str(Path(__file__).resolve())
PUBLIC_SUBNET = "10.77.0"  # /24 of the public segment; home networks are 192.168.<n>.0/24
_LIVE_BEDS: list[NetBed] = []


class BedUnavailableError(RuntimeError):
    """Namespaces cannot be made here; the message says why (tests turn it into a skip)."""


def unavailable_reason() -> str | None:
    """Why this machine cannot host a bed, or None when it can (root, ip, nft, tc, a probe namespace)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install -y iproute2 nftables)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """Kill every process still inside ``ns``, then delete it (a namespace with live processes lingers)."""
    for _ in range(3):
        pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _sh("ip", "netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by bed runs whose process is gone; return their names."""
    removed = []
    for ns in list_namespaces():
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        if not alive:
            _kill_namespace(ns)
            removed.append(ns)
    return removed


@dataclass
class Host:
    """One machine of the bed: a namespace, the address others see it by, and its LAN address."""

    bed: NetBed
    name: str
    ns: str
    addr: str  # the address a public host reaches (the router's, for a home host)
    local_addr: str  # the address on its own interface
    router: Host | None = None
    switch_port: str = ""  # its veth end on the bridge (the router's, for a home host)
    forwarded: tuple[int, ...] = field(default_factory=tuple)

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def run(self, *args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        """Run a command in this host and wait for it."""
        return _sh(*self.cmd(*args), check=check, timeout=timeout)

    def popen(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        """Start a process in this host, in its own process group; the bed kills it at teardown."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(self.cmd(*args), text=True, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.bed.procs.append(proc)
        return proc

    def tool(self, *args: str, timeout: float = 20) -> str:
        """Run this module's network tool in the host; return its stdout (raises when it fails)."""
        return self.run(sys.executable, TOOL, *args, timeout=timeout).stdout.strip()

    def tool_popen(self, *args: str) -> subprocess.Popen[str]:
        return self.popen(sys.executable, TOOL, *args)


class NetBed:
    """The namespaces of one test; ``close()`` (or ``with``) removes all of them, also after errors."""

    def __init__(self, public_subnet: str = PUBLIC_SUBNET) -> None:
        """``public_subnet``: first three octets of the public /24 (libp2p treats RFC 1918 addresses as
        private, so NAT-traversal experiments pass a range it calls public; it stays inside the bed)."""
        reason = unavailable_reason()
        if reason:
            raise BedUnavailableError(reason)
        self.public_subnet = public_subnet
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.hosts: dict[str, Host] = {}
        self._next_public = 10
        self._next_home = 1
        self.blocks: list[str] = []  # the /24s of public hosts on networks of their own, routed on the segment
        self._next_in: dict[str, int] = {}  # /24 prefix -> the next free host number there (add_addresses)
        self.switch = self._namespace("sw")
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        _LIVE_BEDS.append(self)

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _plug(self, ns: str, addr: str, port_name: str) -> None:
        """A veth from ``ns`` (eth0) to the switch's bridge (port ``port_name``), eth0 gets ``addr``/24."""
        _sh("ip", "-n", self.switch, "link", "add", port_name, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", self.switch, "link", "set", port_name, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        own = addr.rsplit(".", 1)[0] + ".0/24"
        for block in [*self.blocks, f"{self.public_subnet}.0/24"]:
            if block != own:  # another network on the same segment: on-link too
                _sh("ip", "-n", ns, "route", "add", block, "dev", "eth0")

    def add_public(self, name: str, own_network: bool = False) -> Host:
        """A host on the public segment with its own address: in the public /24 of the other public hosts and of
        the home routers, or (``own_network``) in a /24 of its own on the same segment, as a stranger's rented
        block is (per-network caps count it apart from the members and the home networks; every host on the
        segment, now and later, routes that /24 to the bridge)."""
        if own_network:
            a, b, c = self.public_subnet.split(".")
            prefix = f"{a}.{b}.{int(c) + 1 + len(self.blocks)}"
            for other in self.hosts.values():
                if other.router is None:  # public hosts and home routers: on the segment
                    _sh("ip", "-n", other.ns, "route", "add", f"{prefix}.0/24", "dev", "eth0")
            self.blocks.append(f"{prefix}.0/24")
            addr = f"{prefix}.10"
            self._next_in[prefix] = 11
        else:
            addr = f"{self.public_subnet}.{self._next_public}"
            self._next_public += 1
        ns = self._namespace(name)
        self._plug(ns, addr, f"p-{name}"[:15])
        host = Host(self, name, ns, addr, addr, switch_port=f"p-{name}"[:15])
        self.hosts[name] = host
        return host

    def add_addresses(self, host: Host, count: int) -> list[str]:
        """Give public ``host`` on a network of its own (``add_public(own_network=True)``) ``count`` more addresses
        in that /24: one network to a per-network cap, many sources to a per-address one. A process binds one as
        its source address to send from it."""
        prefix = host.addr.rsplit(".", 1)[0]
        first = self._next_in.get(prefix)
        if host.router is not None or first is None or not 1 <= count <= 254 - first:
            raise ValueError("add_addresses: a public host on a network of its own, and room in its /24")
        addrs = [f"{prefix}.{i}" for i in range(first, first + count)]
        for addr in addrs:
            _sh("ip", "-n", host.ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        self._next_in[prefix] = first + count
        return addrs

    def add_home(self, name: str, forward_ports: Sequence[int] = ()) -> Host:
        """A host at 192.168.<n>.2 behind its own NAT router (masquerade; ``forward_ports`` DNAT'd to it)."""
        n = self._next_home
        self._next_home += 1
        wan = f"{self.public_subnet}.{100 + n}"
        lan_router, lan_host = f"192.168.{n}.1", f"192.168.{n}.2"
        router_ns = self._namespace(f"{name}r")
        self._plug(router_ns, wan, f"r-{name}"[:15])
        ns = self._namespace(name)
        _sh("ip", "-n", router_ns, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", router_ns, "addr", "add", f"{lan_router}/24", "dev", "lan0")
        _sh("ip", "-n", router_ns, "link", "set", "lan0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{lan_host}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", lan_router)
        _sh("ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._nat_rules(router_ns, lan_host, tuple(forward_ports))
        router = Host(self, f"{name}r", router_ns, wan, wan, switch_port=f"r-{name}"[:15])
        host = Host(self, name, ns, wan, lan_host, router=router, switch_port=router.switch_port,
                    forwarded=tuple(forward_ports))
        self.hosts[router.name] = router
        self.hosts[name] = host
        return host

    @staticmethod
    def _nat_rules(router_ns: str, lan_host: str, ports: tuple[int, ...]) -> None:
        """Masquerade the LAN; drop new connections from the WAN except the forwarded ports."""
        dnat = ""
        if ports:
            port_set = ", ".join(str(p) for p in ports)
            dnat = (f"    iifname \"eth0\" tcp dport {{ {port_set} }} dnat to {lan_host}\n"
                    f"    iifname \"eth0\" udp dport {{ {port_set} }} dnat to {lan_host}\n")
        rules = (
            "table ip home {\n"
            "  chain prerouting { type nat hook prerouting priority dstnat; policy accept;\n"
            f"{dnat}  }}\n"
            "  chain postrouting { type nat hook postrouting priority srcnat; policy accept;\n"
            "    oifname \"eth0\" masquerade\n  }\n"
            "  chain forward { type filter hook forward priority filter; policy drop;\n"
            "    ct state established,related accept\n"
            "    iifname \"lan0\" accept\n"
            "    ct status dnat accept\n  }\n"
            "}\n"
        )
        done = subprocess.run(["ip", "netns", "exec", router_ns, "nft", "-f", "-"], input=rules,
                              capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            raise RuntimeError(f"nft rules for {router_ns} failed: {done.stderr.strip()}")

    def shape(self, host: Host, rate_mbit: float, kind: str = "tbf") -> None:
        """Limit ``host``'s link to ``rate_mbit`` both ways (its eth0 egress and the switch port's egress).

        A home host is shaped on its router's WAN link, like a home uplink.
        """
        target = host.router or host
        for ns, dev in ((target.ns, "eth0"), (self.switch, host.switch_port)):
            if kind == "tbf":
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "50ms")
            elif kind == "htb":
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
                    "htb", "default", "10")
                _sh("ip", "netns", "exec", ns, "tc", "class", "replace", "dev", dev, "parent", "1:",
                    "classid", "1:10", "htb", "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit")
            else:
                raise ValueError(f"unknown shaping kind {kind!r}: use tbf or htb")

    def close(self) -> None:
        """Kill every process started in the bed, then delete its namespaces (and so its veths)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    stream.close()
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _kill_namespace(ns)
        self.namespaces.clear()
        if self in _LIVE_BEDS:
            _LIVE_BEDS.remove(self)


@atexit.register
def _close_live_beds() -> None:
    for bed in list(_LIVE_BEDS):
        bed.close()


# ---- topologies -------------------------------------------------------------------------------------------


def three_public(bed: NetBed) -> list[Host]:
    """(a) three hosts on the public segment."""
    return [bed.add_public(f"pub{i}") for i in range(3)]


def two_public_two_home(bed: NetBed) -> tuple[list[Host], list[Host]]:
    """(b) two public hosts and two home hosts, each home behind its own masquerading router."""
    return [bed.add_public(f"pub{i}") for i in range(2)], [bed.add_home(f"home{i}") for i in range(2)]


def port_forwarded(bed: NetBed, ports: Sequence[int] = (31400, 31401)) -> tuple[Host, Host]:
    """(c) a public host and a home host whose router forwards ``ports`` to it (it announces ``home.addr``)."""
    return bed.add_public("pub0"), bed.add_home("home0", forward_ports=ports)


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def open_bed(public_subnet: str = PUBLIC_SUBNET) -> Iterator[NetBed]:
    """A bed that is closed however the block ends (exception, KeyboardInterrupt, SIGTERM turned into one)."""
    cleanup_stale()
    bed = NetBed(public_subnet)
    previous = None
    with contextlib.suppress(ValueError):  # signal handlers only in the main thread
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        yield bed
    finally:
        bed.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def wait_ready(proc: subprocess.Popen[str], timeout: float = 10) -> None:
    """Wait for a tool process (serve/sink) to print "ready"; raise with its stderr when it dies first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == "ready":
            return
        if not line and proc.poll() is not None:
            raise RuntimeError(f"tool exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise TimeoutError("tool did not become ready")


def can_connect(src: Host, addr: str, port: int, timeout: float = 2.0) -> tuple[bool, str]:
    """Try a TCP connection from ``src``: (True, address the server saw) or (False, the error)."""
    done = src.run(sys.executable, TOOL, "connect", addr, str(port), str(timeout), check=False, timeout=timeout + 10)
    return (True, done.stdout.strip()) if done.returncode == 0 else (False, done.stderr.strip())


def measure_throughput(src: Host, dst: Host, seconds: float = 2.0, port: int = 5201) -> float:
    """Mbit/s of one TCP stream from ``src`` to ``dst`` (at ``dst.local_addr``; use a public one)."""
    sink = dst.tool_popen("sink", str(port))
    wait_ready(sink)
    src.tool("source", dst.addr, str(port), str(seconds), timeout=seconds + 20)
    out, _ = sink.communicate(timeout=20)
    total, elapsed = out.split()
    return int(total) * 8 / float(elapsed) / 1e6


# ---- the in-namespace network tool ------------------------------------------------------------------------


def _serve(port: int) -> None:
    """Accept connections; tell each client the address it came from, then echo (one thread per client)."""
    import threading

    def echo(conn: socket.socket, peer: tuple[str, int]) -> None:
        with conn:
            conn.sendall(f"{peer[0]}\n".encode())
            while data := conn.recv(65536):
                conn.sendall(data)

    with socket.create_server(("0.0.0.0", port)) as srv:
        print("ready", flush=True)
        while True:
            conn, peer = srv.accept()
            threading.Thread(target=echo, args=(conn, peer), daemon=True).start()


def _connect(host: str, port: int, timeout: float) -> None:
    """Print the address the server saw us come from; exit 1 with the error when the connection fails."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            print(conn.makefile().readline().strip())
    except OSError as err:
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)


def _sink(port: int) -> None:
    """Receive one connection to its end; print received bytes and the seconds from first to last byte."""
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            total, first = 0, None
            while data := conn.recv(1 << 20):
                if first is None:
                    first = time.perf_counter()
                total += len(data)
            last = time.perf_counter()
    print(f"{total} {last - (first or last):.6f}", flush=True)


def _source(host: str, port: int, seconds: float) -> None:
    chunk = b"\0" * (1 << 16)
    with socket.create_connection((host, port), timeout=10) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(chunk)


def _rtt(host: str, port: int, count: int) -> None:
    """Median round trip of 1-byte messages over one TCP connection to a ``serve`` (ms)."""
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.makefile().readline()
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    print(f"{samples[len(samples) // 2]:.3f}")


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "serve":
        _serve(int(args[0]))
    elif cmd == "connect":
        _connect(args[0], int(args[1]), float(args[2]) if len(args) > 2 else 3.0)
    elif cmd == "sink":
        _sink(int(args[0]))
    elif cmd == "source":
        _source(args[0], int(args[1]), float(args[2]))
    elif cmd == "rtt":
        _rtt(args[0], int(args[1]), int(args[2]) if len(args) > 2 else 50)
    else:
        raise SystemExit(f"unknown command {cmd!r}: serve|connect|sink|source|rtt")


if __name__ == "__main__":
    main(sys.argv[1:])
