"""Owner limits as the planner and the transport see them: an upload/download cap prices a peer's links (the
plan never assumes more than the owner allows), the shaper holds a process's total upload to its cap over
every destination at once, and --max-vram caps the memory a peer advertises."""

from __future__ import annotations

import numpy as np
import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.net.shaping import CappedLink, LinkShaper, LinkTable, set_upload_cap, upload_cap
from tasklet.peer.node.daemon import PeerOptions, owner_limits
from tasklet.peer.node.planning import build_cluster, owner_cap_bps, workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.scheduler import plan

CAP_MBPS = 5.0
SPEC = RunSpec(run_id="caps", model=ModelConfig(n_layers=4, d_model=256, n_heads=4, seq_len=256), micro_batch=4,
               n_microbatches=8)


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)


def _advert(i: int, tflops: float, **extra: float) -> Advert:
    peer_id = f"Qm{'abcdefghijkmnopqrstuvwxyz'[i]}" + "1" * 44
    return Advert(peer_id=peer_id, endpoint=f"127.0.0.{i + 2}:5000",
                  device=DeviceInfo(f"dev{i}", "cuda", 80 * 10**9, tflops, True, False), started_at=float(i),
                  extra=dict(extra))


def _cluster(adverts: list[Advert]):  # noqa: ANN202 - ClusterView
    links = [LinkReport(src=a.peer_id, dst=b.peer_id, rtt_s=0.002, bandwidth_bps=1e9, measured=True, at=0.0)
             for a in adverts for b in adverts if a is not b]
    return build_cluster(adverts, links)


def test_caps_bound_the_capped_peers_links() -> None:
    adverts = [_advert(0, 1.0, max_upload_mbps=CAP_MBPS, max_download_mbps=20.0), _advert(1, 1.0), _advert(2, 1.0)]
    bw = _cluster(adverts).cluster.bandwidth_bps
    assert np.all(bw[0, 1:] <= CAP_MBPS * 1e6) and np.all(bw[1:, 0] <= 20e6)
    assert np.all(bw[1:, 1:][~np.eye(2, dtype=bool)] > 100e6)  # the others keep what they measured


@pytest.mark.parametrize("bad", [-1.0, 0.0, True, "5", 1e12, [5]])  # nan/inf: no advert carries them (JSON)
def test_a_bad_cap_caps_nothing(bad: object) -> None:
    assert owner_cap_bps(_advert(0, 1.0, max_upload_mbps=bad), "max_upload_mbps") is None  # type: ignore[arg-type]


def test_a_capped_peer_is_never_planned_on_a_link_that_needs_more() -> None:
    w = workload_for(SPEC, stages=2, replicas=1)
    stages = [(0, 2), (2, 4)]
    # the capped peer is the fastest device: without its cap the plan would take it
    fast_capped = [_advert(0, 4.0, max_upload_mbps=CAP_MBPS), _advert(1, 1.0), _advert(2, 1.0)]
    uncapped = [_advert(0, 4.0), _advert(1, 1.0), _advert(2, 1.0)]
    assert 0 in {d for row in plan(_cluster(uncapped).cluster, w, stages=stages, seed=0).pipelines for d in row}
    chosen = plan(_cluster(fast_capped).cluster, w, stages=stages, seed=0)
    assert 0 not in {d for row in chosen.pipelines for d in row}, chosen.pipelines
    # with no other choice, the plan is priced at the cap: what the capped peer sends in a step (one activation
    # per micro-batch forward, or one activation gradient back) takes at least bytes / cap
    forced = _cluster(fast_capped[:2]).cluster
    p = plan(forced, w, stages=stages, seed=0)
    sent_bits = 8 * w.activation_bytes() * SPEC.n_microbatches
    assert p.predicted["total_s"] >= sent_bits / (CAP_MBPS * 1e6)
    assert plan(_cluster(uncapped[:2]).cluster, w, stages=stages, seed=0).predicted["total_s"] < sent_bits / 5e6


def test_upload_cap_holds_over_every_destination_at_once() -> None:
    clock = VirtualClock()
    cap = LinkShaper(CAP_MBPS * 1e6, clock=clock, sleep=clock.sleep)
    fast = CappedLink(None, 0.0, cap=cap, clock=clock, sleep=clock.sleep)  # an unshaped link
    slow = CappedLink(1e6, 0.0, cap=cap, clock=clock, sleep=clock.sleep)  # a link slower than the cap
    size = 625_000  # 5 Mbit: one second at the cap
    chunks = [size // 10] * 10
    list(fast.shape(chunks, lambda n: n, total_bytes=size))
    assert clock.t == pytest.approx(1.0)
    list(fast.shape(chunks, lambda n: n))  # booked chunk by chunk: the same cap
    assert clock.t == pytest.approx(2.0)
    start = clock.t
    list(slow.shape(chunks, lambda n: n, total_bytes=size))  # the link, not the cap, is the bottleneck here
    assert clock.t - start == pytest.approx(5.0)
    assert cap.bytes_sent == 3 * size
    assert fast.chunk_bytes(1 << 20) == cap.chunk_bytes(1 << 20) < 1 << 20  # chunks paced at the cap's rate


def test_set_upload_cap_shapes_every_link_of_a_table() -> None:
    set_upload_cap(CAP_MBPS * 1e6)
    try:
        table = LinkTable(lambda dest: (1e9, 0.01) if dest == "emulated" else None)
        plain, emulated = table.get("plain"), table.get("emulated")
        assert isinstance(plain, CappedLink) and plain.rate_bps is None and plain.cap is upload_cap()
        assert isinstance(emulated, CappedLink) and emulated.rate_bps == 1e9 and emulated.delay_s == 0.01
    finally:
        set_upload_cap(None)
    assert LinkTable(lambda dest: None).get("plain") is None
    with pytest.raises(ValueError):
        set_upload_cap(0.0)


def test_owner_limits_cap_advertised_memory_and_announce_the_caps() -> None:
    device = DeviceInfo("gpu", "cuda", 24 * 10**9, 50.0, True, False)
    opts = PeerOptions(max_vram_gb=8.0, max_upload_mbps=CAP_MBPS, max_download_mbps=None)
    capped, extra = owner_limits(device, {"region": "eu"}, opts)
    assert capped.memory_bytes == 8 * 10**9 and capped.tflops == 50.0
    assert extra == {"region": "eu", "max_upload_mbps": CAP_MBPS}
    same, _ = owner_limits(device, {}, PeerOptions(max_vram_gb=100.0))
    assert same.memory_bytes == 24 * 10**9  # a cap above the device changes nothing
