"""An owner's --schedule: parsing, which moments are inside a window (over midnight too), what the schedule asks
of a running or paused peer, and the leader leaving a peer out of plans shortly before its window ends."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.node import leader_role
from tasklet.peer.node.daemon import PeerOptions, owner_limits
from tasklet.peer.node.leader_role import LeaderRole
from tasklet.peer.node.schedule import SCHEDULE_NOTICE_S, ScheduleError, action, leaves_at, leaving_soon, parse_schedule

NIGHT = parse_schedule("22:00-08:00")


def at(h: int, m: int = 0, s: int = 0, day: int = 2) -> datetime:
    return datetime(2026, 12, day, h, m, s).astimezone()


def test_a_window_over_midnight() -> None:
    assert NIGHT.active(at(23)) and NIGHT.active(at(0)) and NIGHT.active(at(7, 59, 59))
    assert not NIGHT.active(at(8)) and not NIGHT.active(at(12)) and not NIGHT.active(at(21, 59, 59))
    assert NIGHT.window_end(at(23)) == at(8, day=3)
    assert NIGHT.window_end(at(3)) == at(8, day=2)
    assert NIGHT.window_end(at(12)) is None
    assert leaves_at(NIGHT, at(23)) == at(8, day=3).timestamp()
    assert leaves_at(NIGHT, at(12)) is None and leaves_at(None, at(12)) is None


def test_several_windows_and_seconds() -> None:
    s = parse_schedule("09:00-12:00, 13:00:30-17:00")
    assert s.active(at(10)) and not s.active(at(12, 30)) and not s.active(at(13, 0, 29)) and s.active(at(13, 0, 30))
    assert parse_schedule("00:00-00:00").active(at(5))  # start == end: the whole day


@pytest.mark.parametrize("text", ["", "22:00", "25:00-08:00", "22:00-08:61", "10-12", "a-b",
                                  ",".join(["1:00-2:00"] * 9)])
def test_bad_schedules_are_refused(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_schedule(text)


def test_what_the_schedule_asks() -> None:
    assert action(NIGHT, at(12), paused=False, paused_by_schedule=False) == "pause"
    assert action(NIGHT, at(23), paused=True, paused_by_schedule=True) == "resume"
    assert action(NIGHT, at(23), paused=True, paused_by_schedule=False) is None  # the owner's pause stays
    assert action(NIGHT, at(23), paused=False, paused_by_schedule=False) is None
    assert action(NIGHT, at(12), paused=True, paused_by_schedule=True) is None
    assert action(None, at(12), paused=False, paused_by_schedule=False) is None


def test_leaving_soon() -> None:
    now = 1_000_000.0
    assert leaving_soon({"leaves_at": now + SCHEDULE_NOTICE_S / 2}, now)
    assert not leaving_soon({"leaves_at": now + SCHEDULE_NOTICE_S * 2}, now)
    for bad in ("soon", True, None, [now]):
        assert not leaving_soon({"leaves_at": bad}, now)
    assert not leaving_soon({}, now)


def test_the_advert_announces_the_window_end() -> None:
    device = DeviceInfo("gpu", "cuda", 8 * 10**9, 10.0, True, False)
    always = parse_schedule("00:00-00:00")
    _, extra = owner_limits(device, {}, PeerOptions(schedule=always))
    assert extra["leaves_at"] > datetime.now().timestamp()
    _, extra = owner_limits(device, {}, PeerOptions())
    assert "leaves_at" not in extra


def test_the_leader_plans_around_a_peer_about_to_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    now = 5_000.0
    monkeypatch.setattr(leader_role, "now", lambda: now)
    adverts = [SimpleNamespace(peer_id="stays", role="worker", extra={}),
               SimpleNamespace(peer_id="later", role="worker", extra={"leaves_at": now + 3 * SCHEDULE_NOTICE_S}),
               SimpleNamespace(peer_id="leaving", role="worker", extra={"leaves_at": now + 10.0}),
               SimpleNamespace(peer_id="watcher", role="client", extra={})]
    role = SimpleNamespace(ctx=SimpleNamespace(live_adverts=lambda: adverts))
    assert sorted(LeaderRole._workers(role)) == ["later", "stays"]  # type: ignore[arg-type]
