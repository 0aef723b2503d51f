"""Only a peer the organiser trusts leads: real `peer` processes, the attacker a real `peer join` with patched methods.

One swarm of four peers (one stage each, so any survivor holds the model), leadership as by default (the
organiser's own peer only):

* peer 1 joins second, runs a modified client whose advert leaves everyone out of ``found`` (its testimony), and
  whose key was generated until its peer id starts with "0" (the smallest ids win the members' ties). It also
  publishes a run record of its own, signed by itself, with an earlier ``created_at`` and another model;
* peer 3 joins after that forgery with the join line's ``--organiser``: it trains the organiser's run.

The attacker never leads while the organiser lives. The organiser is then killed: the survivors wait, alive, and
`peer status` says why; the attacker still never leads. The organiser names a steward with its key (`peer
stewards`), the steward joins, takes over and the run finishes: the saved parameters equal single-process training.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import (
    PEER_COMMAND,
    PeerProcesses,
    child_env,
    launch,
    poll_until,
    status_json,
    write_small_config,
)
from tasklet.peer.emulation.reference_check import gap_to_reference
from tasklet.peer.identity.keys import Identity

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

STEPS = 10
PATCHED = '''\
"""A volunteer's modified client: it testifies for nobody and forges a run record, then the ordinary CLI."""
import sys

from tasklet.peer.swarm.charter import sign_run
from tasklet.peer.swarm.membership import Membership
from tasklet.peer.timing import now

honest_announce = Membership.announce


def announce(self, advert):
    first = self._found is None
    if first:
        self._found = []  # leaves the organiser (and everyone) out of its testimony
    stored = honest_announce(self, advert)
    if first and self._run is not None:
        forged = {**self._run.config, "model": {**self._run.config["model"], "d_model": 48}}
        payload = {"config": forged, "created_at": 0.0, "organiser": sign_run(self.identity, self.run_id, forged, 0.0)}
        print("FORGED", self.store.put("run", payload, now() + 60, suffix=b"/forged"), file=sys.stderr, flush=True)
    return stored


Membership.announce = announce

from tasklet.peer.cli import main

sys.exit(main())
'''


def small_id_identity(path: Path, below: str) -> Identity:
    """A key generated until its peer id sorts below ``below`` (the attacker grinds for the members' tie-break)."""
    while True:
        identity = Identity.generate()
        if identity.peer_id < below:
            identity.save(path)
            return identity


def high_id_identity(path: Path) -> Identity:
    """A key whose peer id starts at "4" or above, so that a lower one takes a few tries to grind, not thousands."""
    while True:
        identity = Identity.generate()
        if identity.peer_id[0] >= "4":
            identity.save(path)
            return identity


def test_a_lying_early_member_never_leads_the_swarm_waits_for_a_steward_and_finishes_equal(tmp_path: Path) -> None:
    save = tmp_path / "result"
    cfg = write_small_config(tmp_path, steps=STEPS, min_peers=4, stages=1)
    organiser_key, steward_key = tmp_path / "organiser.key", tmp_path / "steward.key"
    organiser_id = high_id_identity(organiser_key).peer_id
    attacker = small_id_identity(tmp_path / "attacker.key", below=organiser_id)
    steward = Identity.load_or_create(steward_key)
    script = tmp_path / "patched_peer.py"
    script.write_text(PATCHED)
    with PeerProcesses(tmp_path, emulate_tflops=0.00005) as procs:  # about two seconds a step
        addr = procs.start(cfg, "--identity", str(organiser_key))
        organiser = Identity.load(organiser_key).peer_id
        assert organiser == organiser_id
        assert f"--organiser {organiser}" in procs.join_line
        cmd = [sys.executable, str(script), "join", "--dht", addr, "--organiser", organiser, "--host", "127.0.0.3",
               "--identity", str(tmp_path / "attacker.key"), "--log-level", "INFO", "--emulate-tflops", "0.00005"]
        proc, log = launch(cmd, procs.log_dir / "peer-1.log", env=child_env())
        procs._logs.append(log)
        procs.procs.append(proc)
        # the forged record is tried; our DHT nodes now refuse a second run record of one writer (records.py), and
        # whether it is stored or not, it must not move the leadership
        poll_until(lambda: {"forged": "FORGED " in procs.log_text(1)}, lambda s: s["forged"], 60,
                   "the attacker's forged run record")
        procs.join(addr, 2)
        procs.join(addr, 3)  # after the forgery, with the join line's --organiser
        # the organiser's log says when all four train (no `peer status` before the kill: one takes seconds on a
        # loaded machine, in which the whole run could end before the organiser is killed)
        poll_until(lambda: {"log": procs.log_text(0)},
                   lambda s: "leader_role: step 1:" in s["log"] and "(4 peers live)" in s["log"], 180,
                   "the organiser's first steps with four peers")
        assert f"of organiser {organiser}" in procs.log_text(3)
        assert f"this peer ({organiser}) leads the swarm" in procs.log_text(0)
        procs.kill(0)  # the organiser's peer dies: nobody else may lead
        addr = procs.join_address(2)
        st = poll_until(lambda: status_json(addr), lambda s: bool((s.get("leadership") or {}).get("waiting")), 60,
                        "the swarm to say it waits for a steward")
        assert st["leadership"]["waiting"] == "waiting for a leader the organiser trusts: 1 steward, none live"
        # nobody else leads, and the run record the survivors keep to is the organiser's
        assert st["plan"]["leader"] in (None, organiser) and st["leadership"]["leaders"] == [organiser]
        assert st["sync"] == {"period": 1, "codec": None, "overlap": False}
        assert attacker.peer_id in {p["peer_id"] for p in st["peers"]} and len(st["peers"]) >= 3
        time.sleep(8)  # waiting is not leaving: every survivor stays, nobody takes the lead
        assert all(p.poll() is None for p in procs.procs[1:]), "a survivor left while waiting"
        out = subprocess.run([*PEER_COMMAND, "stewards", steward.peer_id, "--identity", str(organiser_key),
                              "--dht", addr], capture_output=True, text=True, timeout=90, env=child_env())
        assert out.returncode == 0, out.stderr[-2000:]
        assert steward.peer_id in out.stdout
        # the steward (a fresh machine) joins; it leads, takes over from the survivors' states and saves
        procs.join(addr, 4, "--identity", str(steward_key), "--save-dir", str(save))
        for i in (2, 3, 4):
            assert procs.procs[i].wait(timeout=300) == 0, f"peer {i} failed:\n{procs.log_text(i)[-3000:]}"
        assert procs.procs[1].wait(timeout=60) == 0
    attacker_log = procs.log_text(1)
    assert "leads the swarm" not in attacker_log
    # its position: peers 2 and 3 found both it and the organiser, it testified for nobody, and its id sorts
    # first, so the members' election (peer.swarm.election.elect_leader) would have made it the leader
    assert attacker.peer_id < organiser
    assert f"this peer ({steward.peer_id}) leads the swarm" in procs.log_text(4)
    assert "role: follower -> waiting" in procs.log_text(2) or "role: resigned -> waiting" in procs.log_text(2)
    gap = gap_to_reference(save, STEPS)
    assert gap.max_abs < 1e-5, f"final parameters differ from single-process training by {gap.max_abs:.2e}"
    assert gap.run["config"]["model"]["d_model"] != 48  # the organiser's model, not the forged record's
