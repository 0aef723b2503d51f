"""Leader election without messages: the organiser's stewards, or (opted in) what the credited peers observed.

**The organiser decides who may lead** (``peer.swarm.charter.LeaderPolicy``, from the run record it signed): by
default only its own peer, or the stewards ``[swarm] leaders`` names, first live one in its order, and an incumbent
steward keeps the lead; while no steward is live nobody leads and the swarm waits (:func:`elect`). What follows
is the members' election, used only where the organiser opted in with ``leaders = "any"``; there a live leader
wins every tie of testimony, so only strictly more credited witnesses move it.

Every peer reads the same live peer records from the DHT, so a pure function of them picks the same leader
everywhere. Each record carries ``found``: the peers its writer saw alive when it joined
(``peer.swarm.membership``). That is testimony about *others*: a peer cannot make itself look older, because
only the other live workers' records count for it. The leader is the worker that the most live witnesses
found already there, i.e. the one that has been in the swarm longest as the others saw it. The oldest peer is
the one most likely to stay (peer lifetimes are heavy-tailed), and a newcomer, which nobody found, never
displaces a working leader, so joins cause no leader churn. No clock is read, so clock skew cannot reorder
the election.

**Who may testify (Sybil weight).** Identities are free: a member holding the join secret can start forty of them,
and forty records that found each other would out-vote every honest peer. So once the run has done work, only
*credited* peers testify: the peers the leader's signed plan lists under ``credited``, those whose pipelines
applied at least one step of the run (``peer.node.leader_role`` keeps the list and carries it over takeovers; the
list travels with plans, so when peers were newly credited the leader re-plans as soon as any peer joins, and a new
identity meets, from the next step boundary on, a plan that says whose testimony counts). A credit costs a peer
real, accepted work, and the list only comes from the leader the reader already follows, so new identities gain
nothing until they have trained, and then each counts once, like any volunteer. Ties go to a credited peer, then to
the one the most live workers found (two sides of a healed partition credit different peers, and this keeps their
elections alike where the credited testimony ties), then to the smallest peer id (a ground-out small id buys
nothing against a credited peer). Before the first credited plan (a forming swarm, no work to protect) every live
worker testifies.

A self-reported start time (``Advert.started_at``) is shown in status but never used here: a newcomer that
claims to have started first gains nothing.

Views can differ briefly while a record propagates or expires; the epochs and quorum of the plan board
(``peer.swarm.plans``) settle that, and the daemon acts on an election only once it has been stable for a
few ticks (``peer.timing.LEADER_CONFIRM_TICKS``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from tasklet.peer.swarm.adverts import check_peer_id
from tasklet.peer.swarm.charter import LeaderPolicy
from tasklet.peer.swarm.membership import PeerEntry

MAX_CREDITED = 4096  # peer ids one plan may credit (the plan board's member bound)


def seniority(entries: Iterable[PeerEntry], credited: Collection[str] = ()) -> dict[str, int]:
    """Peer id of each live worker -> how many other live witnesses found it alive when they joined. A witness
    is any live worker while ``credited`` is empty, else a live worker that ``credited`` names."""
    workers = [entry for entry in entries if entry.advert.role == "worker"]
    ids = {entry.advert.peer_id for entry in workers}
    counts = dict.fromkeys(ids, 0)
    for entry in workers:
        if credited and entry.advert.peer_id not in credited:
            continue
        for found in entry.found & ids:
            if found != entry.advert.peer_id:
                counts[found] += 1
    return counts


def elect_leader(entries: Iterable[PeerEntry], credited: Collection[str] = (),
                 incumbent: str | None = None) -> str | None:
    """The live worker most witnesses found already there (ties: the ``incumbent``, the leader the reader follows;
    then a credited one, then the one most live workers found, then the smallest id); None if there is no worker."""
    entries = list(entries)
    counts = seniority(entries, credited)
    if not counts:
        return None
    plain = seniority(entries) if credited else counts
    return min(counts, key=lambda peer_id: (-counts[peer_id], peer_id != incumbent,
                                            bool(credited) and peer_id not in credited, -plain[peer_id], peer_id))


def elect(entries: Iterable[PeerEntry], credited: Collection[str], policy: LeaderPolicy | None,
          incumbent: str | None = None) -> str | None:
    """The leader under the organiser's ``policy`` (None: the members' election, as before any policy is known).

    Stewards: the ``incumbent`` (the leader of the plan the reader follows) while it is a live steward, else the
    first live steward in the organiser's order; None while no steward is live (the swarm waits). ``any``: the
    incumbent while it is live (no testimony moves a working leader), else the members' election. A deposed or
    resigned leader is not passed as ``incumbent`` (``peer.swarm.view``)."""
    entries = list(entries)
    live = [entry.advert.peer_id for entry in entries if entry.advert.role == "worker"]
    if policy is None:
        return elect_leader(entries, credited)
    if not policy.any:
        if incumbent in live and policy.may_lead(incumbent):
            return incumbent
        return next((p for p in policy.stewards if p in live), None)
    return elect_leader(entries, credited, incumbent if incumbent in live else None)


def credited_of(plan: dict[str, Any] | None) -> frozenset[str]:
    """The peers a plan credits with accepted work (empty for none, or for a malformed list: a bad list must
    not make the reader believe some peers are credited)."""
    value = (plan or {}).get("credited")
    if not isinstance(value, list) or len(value) > MAX_CREDITED:
        return frozenset()
    try:
        return frozenset(check_peer_id(item, "credited[]") for item in value)
    except ValueError:
        return frozenset()


def bootstrap_credited(entries: list[PeerEntry], plans: Iterable[tuple[str, dict[str, Any]]]) -> frozenset[str]:
    """The credited set for a reader that follows no plan yet (a joiner, ``peer status``): that of the newest
    plan (``plans``: (signer, plan), newest first) whose signer its own credited peers elect. A reader that
    follows a plan takes that plan's list instead; see the module docstring for what a joiner must trust."""
    for leader_id, plan in plans:
        credited = credited_of(plan)
        if credited and elect_leader(entries, credited) == leader_id:
            return credited
    return frozenset()
