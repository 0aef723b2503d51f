"""Leader election without messages, from what the other peers observed.

Every peer reads the same live peer records from the DHT, so a pure function of them picks the same leader
everywhere. Each record carries ``found``: the peers its writer saw alive when it joined
(``peer.swarm.membership``). That is testimony about *others*: a peer cannot make itself look older, because
only the other live workers' records count for it. The leader is the worker that the most live workers
found already there, i.e. the one that has been in the swarm longest as the others saw it (ties: smallest
peer id). The oldest peer is the one most likely to stay (peer lifetimes are heavy-tailed), and a newcomer,
which nobody found, never displaces a working leader, so joins cause no leader churn. No clock is read, so
clock skew cannot reorder the election.

A self-reported start time (``Advert.started_at``) is shown in status but never used here: a newcomer that
claims to have started first gains nothing. In an open swarm (no join secret) a crowd of fake identities
could testify for one of them; the join secret is what keeps such identities out.

Views can differ briefly while a record propagates or expires; the epochs and quorum of the plan board
(``peer.swarm.plans``) settle that, and the daemon acts on an election only once it has been stable for a
few ticks (``peer.timing.LEADER_CONFIRM_TICKS``).
"""

from __future__ import annotations

from collections.abc import Iterable

from peer.swarm.membership import PeerEntry


def seniority(entries: Iterable[PeerEntry]) -> dict[str, int]:
    """Peer id of each live worker -> how many other live workers found it alive when they joined."""
    workers = [entry for entry in entries if entry.advert.role == "worker"]
    ids = {entry.advert.peer_id for entry in workers}
    counts = dict.fromkeys(ids, 0)
    for entry in workers:
        for found in entry.found & ids:
            if found != entry.advert.peer_id:
                counts[found] += 1
    return counts


def elect_leader(entries: Iterable[PeerEntry]) -> str | None:
    """The live worker most others found already there (ties: smallest id); None if there is no worker."""
    counts = seniority(entries)
    if not counts:
        return None
    return min(counts, key=lambda peer_id: (-counts[peer_id], peer_id))
