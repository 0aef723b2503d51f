"""A peer's role in the swarm as one state machine: follower, candidate, leader, waiting for a steward, resigned,
done.

The daemon's control loop observes the swarm once a tick (who the confirmed leader is, whether the organiser's
stewards are all gone, whether this peer may take the lead yet, how its leader role and the run stand) and hands
that to :func:`transition`, which returns the next state and what the daemon must do (start or stop the leader
role, resign, leave). It reads no clock and does no I/O, so every rule of who leads when lives here and is tested
in virtual time (``tests/test_roles.py``); the daemon only carries the actions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(Enum):
    FOLLOWER = "follower"  # another peer leads (or nobody is confirmed yet) and a leader may come
    CANDIDATE = "candidate"  # elected, but not yet allowed to lead (a fresh joiner, another leader's fresh beat)
    LEADER = "leader"  # runs the leader role
    WAITING = "waiting"  # only the organiser's stewards may lead and none is live: the swarm pauses
    RESIGNED = "resigned"  # stepped down this tick (the election moved); a follower from the next tick
    DONE = "done"  # the run is over (or the leader role failed): the daemon leaves


class Action(Enum):
    START_ROLE = "start_role"  # start the leader role
    STOP_ROLE = "stop_role"  # stop the leader role (it no longer leads)
    RESIGN = "resign"  # tell the followers (the beat says "resigned"): they elect again at once
    LEAVE = "leave"  # the run is over for this peer


@dataclass(frozen=True)
class Observed:
    """One tick's view. ``leader``: the confirmed leader (None while the election settles or nobody may lead);
    ``waiting``: only stewards may lead and none is live; ``may_lead``: this peer's guards allow it to take the
    lead; ``role_finished`` / ``role_failed``: how this peer's leader role stands; ``run_done``: the followed
    leader reported "done" at the signed last step (a "done" elsewhere is refused before it gets here);
    ``role_stopped``: the leader role gave up the lead before the run's end (its plan was refused: a newer plan
    was accepted, or the quorum was lost), which ends the leadership, not the run."""

    me: str
    leader: str | None
    waiting: bool = False
    may_lead: bool = True
    role_finished: bool = False
    role_failed: bool = False
    run_done: bool = False
    role_stopped: bool = False


def transition(state: State, seen: Observed) -> tuple[State, tuple[Action, ...]]:
    """The next state and the daemon's actions, in order."""
    if state is State.DONE:
        return state, ()
    if state is State.LEADER:
        if seen.role_stopped:  # a follower again: the election goes on, and may name this peer again
            return State.RESIGNED, (Action.STOP_ROLE, Action.RESIGN)
        if seen.role_finished:
            return State.DONE, ((Action.RESIGN, Action.LEAVE) if seen.role_failed else (Action.LEAVE,))
        if seen.leader is not None and seen.leader != seen.me:
            return State.RESIGNED, (Action.STOP_ROLE, Action.RESIGN)
        return State.LEADER, ()
    if seen.run_done:
        return State.DONE, (Action.LEAVE,)
    if seen.leader == seen.me:
        if seen.may_lead:
            return State.LEADER, (Action.START_ROLE,)
        return State.CANDIDATE, ()
    if seen.leader is None and seen.waiting:
        return State.WAITING, ()
    return State.FOLLOWER, ()
