"""Members that lie about themselves, as real `peer` processes with the join secret: neither can crash, stall
or end the run, and the model is the one single-process training gives.

One swarm of five peers (one stage each: every peer holds the whole model, so any survivor holds it):

* peer 2 runs a patched client whose every loss report is NaN (``Outbox.report`` replaced): the coordinator
  refuses each with INVALID_ARGUMENT and publishes those steps without a loss, instead of failing to serialise
  its progress record and exiting;
* peer 3 runs a patched client whose Status reply claims 10^9 trained steps (``StageWorker.status``
  replaced). The leader (peer 0) is killed mid-run; the new leader asks every worker how far it got, finds the
  claim beyond the step its predecessor signed in the progress record, leaves peer 3 out and goes on, instead
  of ending the run at "step 10^9";
* peer 4's Status reply names parameters (a hash) that are not those the dead leader signed for the stage at
  that step: the new leader does not count it as a holder of the stage.

The honest survivor finishes every step, and the saved parameters equal single-process training within 1e-5.
The contribution record survives the leader's death: while the new leader trains, `peer credits --json --me
KEY` shows the dead leader's identity (which the new leader never planned) credited in a record the new leader
signed, and run.json's record adds up to the micro-batches of the steps it credits.
The same swarm without liars, through the same leader death, is tests/swarms/test_swarm_daemon.py (the control run).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import PEER_COMMAND, PeerProcesses, child_env, launch, poll_until, write_small_config
from tasklet.peer.emulation.reference_check import gap_to_reference
from tasklet.peer.identity.keys import Identity

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

SECRET = "byzantine-claims-secret"
STEPS = 8
MICROBATCHES = 8  # n_microbatches of write_small_config
PATCHED = '''\
"""A volunteer's modified client: one method of the real one replaced, then the ordinary CLI."""
import dataclasses
import sys

from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.stage.outbox import Outbox
from tasklet.peer.runtime.stage.worker import StageWorker

LIE = sys.argv.pop(1)
if LIE == "nan-loss":
    honest_report = Outbox.report

    def report(self, t, msg):
        if isinstance(msg, ctl.Loss):
            msg = dataclasses.replace(msg, loss=float("nan"))
        return honest_report(self, t, msg)

    Outbox.report = report
elif LIE == "trained-steps":
    honest_status = StageWorker.status
    StageWorker.status = lambda self: {**honest_status(self), "trained_steps": 10**9}
elif LIE == "params-hash":
    honest_status = StageWorker.status
    StageWorker.status = lambda self: {**honest_status(self), "params_hash": "f" * 32}
else:
    raise SystemExit(f"unknown lie {LIE!r}")

from tasklet.peer.cli import main

sys.exit(main())
'''


def _steps_of_five(log: str) -> int:
    """Steps the leader logged as done in a plan of five pipelines (0 before it planned all five)."""
    if not re.search(r"plan epoch \d+ \(.*pipelines \[(\[\d+\], ){4}\[\d+\]\]", log):
        return 0
    return len(re.findall(r"leader_role: step \d+:", log))


def join_patched(procs: PeerProcesses, script: Path, lie: str, addr: str, i: int) -> subprocess.Popen[str]:
    """Peer ``i`` as PeerProcesses.join starts it, but running the patched client; closed with the others."""
    cmd = [sys.executable, str(script), lie, "join", "--dht", addr, "--secret", SECRET, "--host", f"127.0.0.{i + 2}",
           "--log-level", "INFO", "--emulate-tflops", str(procs.emulate_tflops)]
    proc, log = launch(cmd, procs.log_dir / f"peer-{i}.log", env=child_env())
    assert log is not None
    procs._logs.append(log)
    procs.procs.append(proc)
    return proc


def credits_of(addr: str, me: Path) -> dict:
    """`peer credits --json --me KEY` against a live swarm (a real CLI process)."""
    out = subprocess.run([*PEER_COMMAND, "credits", "--dht", addr, "--secret", SECRET, "--json", "--me", str(me)],
                         capture_output=True, text=True, timeout=60, env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_nan_loss_liar_and_a_trained_steps_liar_neither_crash_nor_end_the_run(tmp_path: Path) -> None:
    save = tmp_path / "result"
    key0 = tmp_path / "peer0.key"
    script = tmp_path / "patched_peer.py"
    script.write_text(PATCHED)
    cfg = write_small_config(tmp_path, steps=STEPS, secret=SECRET, min_peers=5, stages=1, leaders="any",
                             extra=f"save_dir = {json.dumps(str(save))}\n")
    with PeerProcesses(tmp_path, emulate_tflops=0.00004) as procs:  # about 2 s a step: time for a takeover
        addr = procs.start(cfg, "--identity", str(key0))
        procs.join(addr, 1, "--secret", SECRET)
        time.sleep(1.0)  # peer 1 is found by the later joiners: the oldest after peer 0, it leads next
        join_patched(procs, script, "nan-loss", addr, 2)
        join_patched(procs, script, "trained-steps", addr, 3)
        join_patched(procs, script, "params-hash", addr, 4)
        # the leader's own log says when it finished step 3 of a plan with all five (a status query is slower)
        trained = poll_until(lambda: {"steps": _steps_of_five(procs.log_text(0))}, lambda s: s["steps"] >= 3, 240,
                             "five peers training three steps")
        procs.kill(0)  # the leader dies; its successor asks the workers how far they got
        killed_at = trained["steps"]
        dead_leader = Identity.load(key0).peer_id
        # the new leader's signed record carries the dead leader's credit (it never planned that peer itself)
        mine = poll_until(lambda: credits_of(procs.join_address(1), key0),
                          lambda c: c.get("leader") not in (None, dead_leader), 120, "the new leader's credit record")
        assert [r["peer_id"] for r in mine["peers"]] == [dead_leader], mine
        assert mine["peers"][0]["microbatches"] > 0, mine
        assert procs.procs[1].wait(timeout=400) == 0, "the honest survivor failed"
        assert procs.procs[2].poll() in (None, 0), "the NaN liar's client crashed"
        logs = {i: procs.log_text(i) for i in range(5)}
    leading = logs[0] + logs[1]
    # the NaN reports were refused with a status, and no leader failed on its progress record
    assert "loss: nan is not a finite number" in leading
    assert "Out of range float values" not in "".join(logs.values())
    assert "leadership ended with an error" not in leading
    # the takeover believed the record, not the claim, and left the liar out
    took = re.search(r"takeover at step (\d+) with stages .* recorded step (\d+)", logs[1])
    assert took is not None, logs[1][-3000:]
    assert int(took.group(2)) <= int(took.group(1)) <= int(took.group(2)) + 1 and int(took.group(1)) >= killed_at - 1
    assert re.search(r"takeover: 127\.0\.0\.5:\d+ is left out: it claims 1000000000 trained steps", logs[1])
    # the state peer 4 claims is not the one the dead leader signed (or, past the record, the replicas share): it is
    # left out of the takeover, or holds nothing and fetches the stage from an honest holder
    assert re.search(r"127\.0\.0\.6:\d+ (is left out: its stage \[0, 4\] at step \d+ hashes 'f{32}'; the leader "
                     r"recorded [0-9a-f]{32}|claims stage \[0, 4\] at step \d+ with parameters hashing 'f{32}')",
                     logs[1]), logs[1][-3000:]
    assert "the run already reached step" not in logs[1]
    assert re.search(r"plan epoch \d+ \(takeover\)", logs[1])
    assert "run finished" in logs[1]
    gap = gap_to_reference(save, STEPS)
    losses = gap.run["loss"]
    assert len(losses) == STEPS, losses
    assert all(x is None or math.isfinite(x) for x in losses), losses
    assert gap.max_abs < 1e-5, f"{gap.max_abs:.2e} off single-process training (relative {gap.max_rel:.2e})"
    # credit adds up: one stage, so every credited micro-batch is one identity's; a step the dead leader left
    # half-applied (finished by its successor) is the only one that may go uncredited
    credit = gap.run["credit"]
    assert STEPS - 1 <= credit["steps"] <= STEPS, credit
    assert credit["total_microbatches"] == MICROBATCHES * credit["steps"], credit
    peers = credit["peers"]
    assert sum(p["microbatches"] for p in peers.values()) + credit["evicted_microbatches"] == \
        credit["total_microbatches"], credit
    assert peers[dead_leader]["microbatches"] >= mine["peers"][0]["microbatches"], credit
    assert peers[dead_leader]["last_step"] < killed_at + 1, credit  # nothing after its death
