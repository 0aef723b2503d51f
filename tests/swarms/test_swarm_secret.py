"""The join secret never leaves the peer, and a peer with a skewed clock is refused: real `peer` processes.

A raw hivemind DHT client (no signature validator, no secret) joins a swarm that has a secret while it
trains and reads every record of the run: the secret is in none of them. Nor is it in the peers' logs, in
`peer status`, or in run.json. A joiner whose clock is 6 s behind (the TASKLET_CLOCK_OFFSET_S test hook)
is refused with a one-line message before it announces anything.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import MSGPackSerializer

from tasklet.peer.emulation.procs import PEER_COMMAND, PeerProcesses, child_env, poll_until, write_small_config
from tests.support.waits import wait_for_text

pytestmark = pytest.mark.usefixtures("processes")

SECRET = "s3cret-never-published-7f1c"
RECORDS = ("peers", "links", "plans", "run", "progress")


def status(addr: str) -> dict:
    proc = subprocess.run([*PEER_COMMAND, "status", "--dht", addr, "--secret", SECRET, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert SECRET not in proc.stdout and SECRET not in proc.stderr
    return json.loads(proc.stdout)


def wait_for_training(addr: str, leader_log: Callable[[], str], timeout_s: float) -> dict:
    """The first `peer status` that shows a trained step, asked once the leader's log has one (a status call costs
    seconds of a core beside the peers starting up)."""
    start = time.monotonic()
    wait_for_text(leader_log, "leader_role: step ", timeout_s, "the leader", 0.5)
    return poll_until(lambda: status(addr), lambda s: (s.get("step") or 0) >= 1 and bool(s["plan"]["epoch"]),
                      timeout_s - (time.monotonic() - start), "a status that shows a trained step")


def raw_records(addr: str) -> dict[str, object]:
    """Every record of the run as a plain hivemind client sees it: no secret, none of our code, only hivemind's
    own signature validator (a signed value is msgpack plus a signature; the validator strips the signature so
    the value can be decoded)."""
    dht = hivemind.DHT(initial_peers=[addr], client_mode=True, start=True, record_validators=[RSASignatureValidator()])
    try:
        out = {}
        for name in RECORDS:
            found = dht.get(f"tasklet:{name}", latest=True, return_future=True).result(timeout=30)
            assert found is not None and isinstance(found.value, dict) and found.value, f"no {name} records"
            out[name] = {subkey: item.value for subkey, item in found.value.items()}
        return out
    finally:
        dht.shutdown()


def test_the_secret_is_in_no_record_log_status_or_run_json_and_skew_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "result"
    # 12 steps: the look (a status, every raw record) is done a few steps in; more steps only added time
    cfg = write_small_config(tmp_path, steps=12, secret=SECRET, min_peers=2, stages=1,
                             extra=f"save_dir = {json.dumps(str(save))}\n")
    with PeerProcesses(tmp_path, emulate_tflops=0.0001) as procs:  # about 1.4 s a step: time to look
        addr = procs.start(cfg)
        procs.join(addr, 1, "--secret", SECRET)
        skewed = subprocess.Popen(
            [*PEER_COMMAND, "join", "--dht", addr, "--secret", SECRET, "--host", "127.0.0.9"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env({"TASKLET_CLOCK_OFFSET_S": "-6"}),
        )
        try:
            wait_for_training(addr, lambda: procs.log_text(0), 180)
            records = raw_records(addr)
            _, skewed_err = skewed.communicate(timeout=120)
        finally:
            if skewed.poll() is None:
                skewed.kill()
        for name, values in records.items():
            blob = MSGPackSerializer.dumps(values)
            assert SECRET.encode() not in blob and SECRET not in repr(values), f"the secret is in {name}"
        for proc in procs.procs:
            assert proc.wait(timeout=300) == 0, "a peer failed"
        logs = "".join(procs.log_text(i) for i in range(2))
        joiner = procs.log_text(1)
    for phase in ("] measuring: this device", "] waiting for a plan: ", "] training: stage 0",
                  "] done: the run is over"):
        assert phase in joiner, f"the joiner showed no {phase!r} line"  # what a volunteer sees (peer.observe.phases)
    assert skewed.returncode != 0
    last = skewed_err.strip().splitlines()[-1]
    assert "clock is" in last and "behind the swarm" in last, skewed_err[-2000:]
    assert "run finished" in logs and SECRET not in logs
    run_json = (save / "run.json").read_text()
    assert SECRET not in run_json and "secret" not in json.loads(run_json)["config"]["swarm"]
