"""Every timing constant of the peer, in one place, so the relations between them can be checked by reading.

Liveness on the DHT (peer.swarm.membership, peer.node.daemon)
    A peer re-stores its signed advert every ``HEARTBEAT_S`` (the default of ``[swarm] heartbeat_s``) with a
    lifetime of ``ADVERT_TTL_HEARTBEATS`` heartbeats: with 3, two heartbeats may be lost (a slow DHT round, a
    GC pause) before others drop the peer, and a peer that dies silently is gone at most one advert lifetime
    after its last heartbeat. Link reports live longer (``peer.swarm.membership.LINK_REPORT_MIN_TTL_S``) and
    the same heartbeat renews them only when they near their expiry.
    The run record (the published run.toml) lives at least ``RUN_RECORD_MIN_TTL_S``.

The daemon's control loop (peer.node.daemon)
    It ticks ``TICKS_PER_HEARTBEAT`` times a heartbeat. A role change needs the same election result on
    ``LEADER_CONFIRM_TICKS`` ticks in a row (1.5 heartbeats), less than one advert lifetime, so a dead
    leader is replaced about as fast as its advert expires. A joiner waits one advert lifetime after
    announcing itself before it may lead (by then it has seen every advert that is alive), and waits at most
    ``JOINER_RUN_WAIT_S`` for the run record to appear.

Progress and plan records (peer.swarm.progress, peer.swarm.plans)
    The leader renews its beat (its progress without the loss history) every tick, and the full progress
    record when it changes or every ``peer.swarm.progress.FULL_RENEW_S``. A worker reads the beat once a
    heartbeat and reads every advert again when the beat is older than one advert lifetime (it suspects the
    leader, ``peer.swarm.view``). The takeover guard looks at the beat's age, not its expiry: nobody takes
    over while another leader's beat is younger than one advert lifetime. Both records live
    ``PROGRESS_TTL_S`` (much longer) so that ``peer status`` and a new leader still read the last step and
    the loss history after the leader died; a new leader looks for its predecessor's record for up to
    ``PREDECESSOR_READ_HEARTBEATS`` heartbeats (one lookup right after a death can miss a record the next
    one finds, and a takeover without it would believe the workers' claims). A plan record lives
    ``PLAN_TTL_S``; the leader renews it every ``PLAN_RENEW_TICKS`` ticks (10 heartbeats, 20 s at the
    default), far within.

The coordinator's view of its workers (peer.runtime.lead.liveness)
    It pings every assigned worker once a heartbeat, concurrently and with at most one ping outstanding per
    worker, with a deadline of at least ``PING_TIMEOUT_S`` (adaptive: see "Stragglers") and declares a worker
    dead after ``PING_MISSES`` misses in a row: on a fast link a dead worker is noticed within about
    ``PING_MISSES * (HEARTBEAT_S + PING_TIMEOUT_S)`` (8 s at the defaults), close to one advert lifetime.
    A failed push or fetch is confirmed by one ping first.

Stragglers: adaptive leases, speculation, pings and bans (peer.runtime.lead.pacing, .liveness, .driver)
    ``STEP_TIMEOUT_S`` is only the lease of a micro-batch until the coordinator knows how long one takes:
    after that a lease lasts ``LEASE_FACTOR`` x the expected lease-to-commit time (the plan's prediction, or
    the median of the last measured ones), at least ``LEASE_FLOOR_S`` and at most ``STEP_TIMEOUT_S``; a
    lease past it fails its pipeline for the step (its work is redone by the others). A pipeline whose head
    micro-batch (the oldest it holds, counted from its lease or the pipeline's last commit) is held longer
    than ``SPECULATE_FACTOR`` x the measured head latency (80th percentile: a step's first micro-batch crosses
    every stage; stretched by the pipeline's known slowness) and than
    ``SPECULATE_FLOOR_S``, or whose oldest micro-batch without a loss report has waited longer than
    ``SPECULATE_FORWARD_FACTOR`` x the measured forward latency (lease or last loss to loss, 80th percentile;
    the same stretch and floor; before a step has ended, only the plan's predicted figure, if any: the first
    commits of a run come from its fastest pipelines and are no yardstick for a slower one's head), is
    overdue: it gets no new micro-batch, and once nothing is free a pipeline holding at most one micro-batch
    gets a speculative copy of its micro-batches, oldest first (well under the
    lease, so a straggler is overtaken long before it is failed; peer.runtime.lead.pool). The loss comes about a
    third of a head latency before the commit, so the forward signal catches a slow pipeline while the others
    still have their last micro-batch in flight, early enough for a copy to pipeline behind it. Its factor is
    smaller: a copy it starts by mistake costs the copier one micro-batch and loses (it becomes a backup); a
    copy that starts late costs the whole step the difference. A pipeline overtaken by a copy reloads its stage
    in the background, off the step's end; a worker that has not reported it in sync within
    ``CONTROL_TIMEOUT_S`` + ``WORKER_FETCH_STATE_TIMEOUT_S`` (being told, then one state fetch) is declared dead.
    A ping's deadline is ``PING_RTT_FACTOR`` x the worker's measured round-trip time (a moving average) plus
    the time its largest message takes on its slowest known link, never under ``PING_TIMEOUT_S`` (which is
    no longer "at most one heartbeat": a ping behind a large transfer on a slow uplink is late, not lost)
    and never over ``PING_TIMEOUT_MAX_S``; ``PING_MISSES`` such misses in a row still mean dead. A dead
    worker is banned from plans for ``BAN_S``, doubled for each new ban of the same endpoint up to
    ``BAN_MAX_S``; a restarted peer is planned again when its ban expires. A worker whose compute time per op
    is more than ``STRAGGLER_FACTOR`` x its stage's median for ``STRAGGLER_STEPS`` steps in a row, or more
    than ``STRAGGLER_FACTOR`` squared x that median in one step (an op still running when the step ends counts
    with its time so far), is reported to the planner, which leaves it out of the next plan when a spare can
    take its place (peer.runtime.lead.driver.StragglerJudge).

Clocks (every record's ``at`` and expiry; :func:`now`)
    Expiry in the DHT is wall-clock time, so peers' clocks must agree. At join a peer compares its clock with
    the heartbeat times in the signed adverts of the live peers (``peer.swarm.membership.check_clock``) and
    refuses to join when the median difference is more than ``MAX_CLOCK_SKEW_S`` (an advert may be up to a
    heartbeat old, which the check allows for). Every lifetime is long compared with that bound: an advert
    lives ``ADVERT_TTL_HEARTBEATS * HEARTBEAT_S`` = 6 s, so a clock 1 s off still leaves it two heartbeats;
    plans and progress live minutes. The leader is chosen without any clock (``peer.swarm.election``), so
    a skew within the bound cannot reorder the election. ``TASKLET_CLOCK_OFFSET_S`` is a test hook: it shifts
    this peer's clock (read once, by :func:`now` only) to emulate a skewed machine.

Deadlines of calls (peer.runtime, peer.node)
    Control messages wait ``CONTROL_TIMEOUT_S``; a broadcast waits that plus ``CONTROL_SLACK_S`` for the
    last answer, but stops waiting for a peer once liveness declared it dead (checked every
    ``BROADCAST_POLL_S``: a peer cut off while a message was on its way must not hold the step).
    Assignments wait ``ASSIGN_TIMEOUT_S`` (workers may fetch a state first). Activations wait
    ``SEND_TIMEOUT_S`` and the gradient exchange (reduce / gather) ``REDUCE_WAIT_S``, both under the step
    deadline ``STEP_TIMEOUT_S``, which is also the lease of a micro-batch in the coordinator's pool (the
    pool's own default lease is ``LEASE_TIMEOUT_S``). A status query waits ``STATUS_TIMEOUT_S``; every DHT
    get/put waits ``DHT_CALL_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _clock_offset_s() -> float:
    """The test hook ``TASKLET_CLOCK_OFFSET_S`` (seconds added to this peer's clock; default 0)."""
    raw = os.environ.get("TASKLET_CLOCK_OFFSET_S", "").strip()
    try:
        return float(raw) if raw else 0.0
    except ValueError:
        raise SystemExit(f"TASKLET_CLOCK_OFFSET_S must be a number of seconds, got {raw!r}") from None


_CLOCK_OFFSET_S = _clock_offset_s()


_CLOCK = time.time  # replaced by a virtual clock in the control-plane simulator (set_clock)


def set_clock(clock: Callable[[], float] | None) -> None:
    """Simulation hook: :func:`now` reads ``clock()`` instead of the wall clock (None restores the wall clock),
    so ``peer.emulation.cpsim`` runs the real control-plane code in deterministic virtual time."""
    global _CLOCK
    _CLOCK = time.time if clock is None else clock


def now() -> float:
    """This peer's wall-clock (DHT) time: what every record's ``at`` and expiry is computed from."""
    return _CLOCK() + _CLOCK_OFFSET_S


# -- liveness on the DHT ----------------------------------------------------------------------------------
HEARTBEAT_S = 2.0  # advert renewal period, default of [swarm] heartbeat_s and of the coordinator's pings
ADVERT_TTL_HEARTBEATS = 3  # advert (and link report) lifetime in heartbeats: two lost heartbeats tolerated
MAX_HEARTBEAT_S = 60.0  # the longest [swarm] heartbeat_s: the DHT's validator bounds an advert's lifetime by it
RUN_RECORD_MIN_TTL_S = 60.0  # the run record lives max(advert lifetime, this) and is renewed by the heartbeat
DHT_CALL_TIMEOUT_S = 5.0  # every DHT get/put of a record store
# a peer's certificate stays trusted this long (at least) after its advert was last read: DHT reads and stores
# that time out while a DHT node is dead (DHT_CALL_TIMEOUT_S each) must not cut a live peer's connections, which
# an advert lifetime of a few short heartbeats would
TRUST_KEEP_MIN_S = 30.0
DHT_STARTUP_TIMEOUT_S = 60.0  # the DHT node must answer within this at start-up (dozens of peers starting
# at once on one busy machine took over 10 s; a bad address or a busy port still fails at once)
MAX_CLOCK_SKEW_S = 1.0  # a joiner whose clock differs from the swarm's by more than this is refused
DHT_RECONNECT_HEARTBEATS = 5  # re-ping the DHT nodes a peer joined through (heals a partitioned DHT)

# -- the daemon's control loop ---------------------------------------------------------------------------
PROGRESS_BUILD_S = 1.0  # a leader rebuilds its progress record's history and credit at most this often
TICKS_PER_HEARTBEAT = 2  # the control loop ticks every heartbeat / 2
LEADER_CONFIRM_TICKS = 3  # the same election result this many ticks in a row before roles change
JOINER_RUN_WAIT_S = 15.0  # a joiner waits this long for the run record to appear in the DHT
LINK_REPORT_WAIT_HEARTBEATS = 3  # the first plan waits this many heartbeats for every peer's link reports
PREDECESSOR_READ_HEARTBEATS = 3  # a new leader looks this long for the previous leader's progress record

# -- progress and plan records ---------------------------------------------------------------------------
PROGRESS_TTL_S = 120.0  # lifetime of a progress record and of a beat (the beat renewed every tick by the leader)
PLAN_TTL_S = 600.0  # lifetime of a plan record
PLAN_RENEW_TICKS = 20  # the leader renews its plan record every this many ticks (10 heartbeats)

# -- link probes -----------------------------------------------------------------------------------------
PROBE_PING_TIMEOUT_S = 10.0  # each of the RTT pings of a link probe
PROBE_TIMEOUT_S = 60.0  # the bandwidth probe of a link

# -- the coordinator -------------------------------------------------------------------------------------
PING_TIMEOUT_S = 2.0  # the least deadline of a liveness ping (adaptive above it: see "Stragglers")
PING_MISSES = 2  # missed pings in a row before a worker is declared dead
STATUS_TIMEOUT_S = 5.0  # a worker's status query
CONTROL_TIMEOUT_S = 30.0  # a control message (assign, reduce, apply, stop, lease, commit)
CONTROL_SLACK_S = 5.0  # a broadcast waits CONTROL_TIMEOUT_S + this for the last answer
BROADCAST_POLL_S = 0.25  # ... checking this often whether a peer it waits for was declared dead (then it stops)
ASSIGN_TIMEOUT_S = 180.0  # every worker accepts its assignment (it may fetch a state first)
ASSIGN_RETRY_HEARTBEATS = 3  # an assignment refused at once is sent again once a heartbeat, this many times
FETCH_STATE_TIMEOUT_S = 60.0  # the coordinator fetches a stage's state
STEP_TIMEOUT_S = 600.0  # one optimizer step; also the lease of a micro-batch in the coordinator's pool
LEASE_TIMEOUT_S = 60.0  # default lease of a micro-batch in a TaskPool built without one
REPLAN_WAIT_S = 0.5  # pause before planning again after a failed step
LEASE_FACTOR = 4.0  # a micro-batch's lease: this x its expected lease-to-commit time ...
LEASE_FLOOR_S = 10.0  # ... at least this (and at most STEP_TIMEOUT_S)
SPECULATE_FACTOR = 1.5  # a head micro-batch held over this x the head latency (80th pct) is overdue ...
SPECULATE_FLOOR_S = 0.25  # ... and than this (a GC pause or jitter on tiny micro-batches is no straggler)
SPECULATE_FORWARD_FACTOR = 1.25  # a micro-batch's loss later than this x the forward latency (80th pct): overdue
PING_RTT_FACTOR = 8.0  # a ping's deadline: this x the measured RTT + the largest message on the slowest link
PING_TIMEOUT_MAX_S = 60.0  # ... at most this
BAN_S = 60.0  # a worker declared dead is left out of plans this long ...
BAN_MAX_S = 1800.0  # ... doubled for each new ban of the same endpoint, up to this
STRAGGLER_FACTOR = 2.0  # compute time per op above this x the stage's median ...
STRAGGLER_STEPS = 2  # ... this many steps in a row: reported to the planner as a straggler
CHECKPOINT_COPIES = 2  # other peers that get a copy of every checkpoint
COPY_TIMEOUT_S = 600.0  # sending one checkpoint copy (in the background; training goes on)
EXIT_STEP_WAIT_S = 20.0  # a leader leaving gracefully lets the step in flight end this long before its checkpoint
EXIT_COPY_WAIT_S = 30.0  # a leader leaving gracefully waits this long for its last checkpoint's copies
TAKEOVER_APPLY_TIMEOUT_S = 10.0  # a new leader tells a worker to apply the step its predecessor left
TAKEOVER_WAIT_S = 30.0  # ... and waits this long for every such worker to have applied it
QUORUM_WAIT_S = 300.0  # [swarm] quorum_wait_s: a leader without a majority pauses this long, then goes on
COORDINATOR_LOST_HEARTBEATS = 5  # a worker that cannot reach its coordinator this long suspects the leader ...
DEPOSE_HEARTBEATS = 30  # ... and elects without it this long (renewed while it stays unreachable)

# -- the worker ------------------------------------------------------------------------------------------
SEND_TIMEOUT_S = 120.0  # pushing an activation or gradient to the next stage
REDUCE_WAIT_S = 120.0  # the gradient exchange (reduce / gather) among the replicas of a stage
WORKER_FETCH_STATE_TIMEOUT_S = 120.0  # a worker fetches its stage's state from a peer or the coordinator
