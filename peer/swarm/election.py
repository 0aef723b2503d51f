"""Leader election without messages.

Every peer reads the same live adverts from the DHT, so a pure function of them picks the same leader
everywhere: the worker that started earliest (ties by peer id). The oldest peer is the one most likely to
stay (peer lifetimes are heavy-tailed: having lasted predicts lasting), and a newcomer never displaces a
working leader, so joins do not cause leader churn. Views can differ briefly while an advert propagates or
expires; the epochs of the plan board (``peer.swarm.plans``) settle that, and the daemon acts on an election
only once it has been stable for a few ticks (``peer.timing.LEADER_CONFIRM_TICKS``).
"""

from __future__ import annotations

from collections.abc import Iterable

from peer.swarm.adverts import Advert


def elect_leader(adverts: Iterable[Advert]) -> str | None:
    """The peer id of the worker with the earliest ``started_at`` (ties: smallest id); None if no worker."""
    workers = [advert for advert in adverts if advert.role == "worker"]
    if not workers:
        return None
    return min(workers, key=lambda advert: (advert.started_at, advert.peer_id)).peer_id
