"""The organiser's signatures: the run's root of trust.

``peer start`` signs the run record with the organiser's identity key, and the join line names the organiser's
peer id (``--organiser``), so a joiner accepts only that organiser's run: a member that publishes a forged run
record (say with an earlier ``created_at``) is not the organiser and is ignored. The signature lives inside the
payload (``{"key", "sig"}``), not in the DHT's owner tag, so any member can keep the exact signed record alive
under its own subkey after the organiser's peer leaves, and every reader checks the same signature.

The organiser also decides who may lead (``[swarm] leaders``, in the signed record): its *stewards*, by default
its own peer only; or ``"any"``, an opt-in to the members' election. ``peer steward add`` adds a steward to a
running swarm with a record the organiser's key signs (:func:`sign_stewards`); readers take the union of every
such record that verifies, since only the organiser can write one.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from hivemind.utils.crypto import RSAPublicKey

from tasklet.peer.identity.keys import Identity, peer_id_from_public_key
from tasklet.peer.swarm.adverts import check_peer_id
from tasklet.peer.swarm.records import canonical_json

ANY = "any"  # [swarm] leaders = "any": credited members elect (opt-in)
MAX_STEWARDS = 64  # peer ids one record may name
MAX_KEY_CHARS = 4096  # an OpenSSH RSA public key
MAX_SIG_CHARS = 2048  # a base64 RSA signature
_DOMAIN_RUN = b"tasklet organiser run v1"
_DOMAIN_STEWARDS = b"tasklet organiser stewards v1"


class CharterError(ValueError):
    """A record that does not carry a valid organiser signature (the message says why, in one line)."""


def _message(domain: bytes, run_id: str, body: dict[str, Any]) -> bytes:
    return b"\x00".join([domain, run_id.encode(), canonical_json(body)])


def seal(identity: Identity, domain: bytes, run_id: str, body: dict[str, Any]) -> dict[str, str]:
    """``{"key", "sig"}``: ``identity``'s signature over ``body`` in ``domain`` (a signature of one kind of record
    can never pass for another's) and ``run_id``."""
    signature = identity.private_key.sign(_message(domain, run_id, body))
    return {"key": identity.public_key.decode(), "sig": base64.b64encode(signature).decode()}


def signer_of(domain: bytes, run_id: str, body: dict[str, Any], sealed: object, who: str = "organiser") -> str:
    """The signer's peer id of the seal ``sealed`` over ``body``; CharterError when it is malformed or does not
    verify."""
    if not isinstance(sealed, dict) or set(sealed) != {"key", "sig"}:
        raise CharterError(f"no {who} signature")
    key, sig = sealed["key"], sealed["sig"]
    if not (isinstance(key, str) and isinstance(sig, str) and len(key) <= MAX_KEY_CHARS and len(sig) <= MAX_SIG_CHARS):
        raise CharterError(f"malformed {who} signature")
    try:
        public = RSAPublicKey.from_bytes(key.encode())
        signature = base64.b64decode(sig.encode(), validate=True)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise CharterError(f"malformed {who} key or signature ({exc})") from None
    except Exception as exc:  # the key parser's own errors (cryptography's UnsupportedAlgorithm, ...)
        raise CharterError(f"unreadable {who} key ({type(exc).__name__})") from None
    if not public.verify(_message(domain, run_id, body), signature):
        raise CharterError(f"the {who} signature does not verify")
    return peer_id_from_public_key(key.encode())


def sign_run(identity: Identity, run_id: str, config: dict[str, Any], created_at: float) -> dict[str, str]:
    """The organiser's signature over the run's configuration and creation time."""
    return seal(identity, _DOMAIN_RUN, run_id, {"config": config, "created_at": float(created_at)})


def run_organiser(run_id: str, payload: dict[str, Any]) -> str:
    """The peer id that signed a run record's payload (``config``, ``created_at``, ``organiser``)."""
    body = {"config": payload.get("config"), "created_at": payload.get("created_at")}
    return signer_of(_DOMAIN_RUN, run_id, body, payload.get("organiser"))


def sign_stewards(identity: Identity, run_id: str, stewards: list[str], revision: int) -> dict[str, Any]:
    """A ``stewards`` record payload: peers the organiser adds to those who may lead."""
    ids = [check_peer_id(p, "steward") for p in stewards]
    if not ids or len(ids) > MAX_STEWARDS:
        raise CharterError(f"a stewards record names 1 to {MAX_STEWARDS} peer ids")
    body = {"stewards": ids, "revision": int(revision)}
    return {**body, "organiser": seal(identity, _DOMAIN_STEWARDS, run_id, body)}


def stewards_of(run_id: str, organiser: str, payload: object) -> tuple[str, ...]:
    """The peer ids a ``stewards`` record adds, if ``organiser`` signed it; CharterError otherwise."""
    if not isinstance(payload, dict) or set(payload) != {"stewards", "revision", "organiser"}:
        raise CharterError("malformed stewards record")
    ids, revision = payload["stewards"], payload["revision"]
    if not isinstance(ids, list) or not ids or len(ids) > MAX_STEWARDS or not isinstance(revision, int) \
            or isinstance(revision, bool):
        raise CharterError("malformed stewards record")
    try:
        ids = [check_peer_id(p, "steward") for p in ids]
    except ValueError as exc:
        raise CharterError(str(exc)) from None
    signer = signer_of(_DOMAIN_STEWARDS, run_id, {"stewards": ids, "revision": revision}, payload["organiser"])
    if signer != organiser:
        raise CharterError(f"signed by {signer}, not by the organiser {organiser}")
    return tuple(ids)


@dataclass(frozen=True)
class LeaderPolicy:
    """Who may lead this run, as the organiser decided: ``stewards`` in order of preference (the organiser's own
    peer first unless the record names others), or ``any`` (the members elect; ``stewards`` is then empty)."""

    organiser: str
    stewards: tuple[str, ...] = ()
    any: bool = False

    @classmethod
    def from_record(cls, organiser: str, leaders: object, added: tuple[str, ...] = ()) -> LeaderPolicy:
        """From the signed record's ``[swarm] leaders`` (None: the organiser only; ``"any"``; a list of peer ids)
        and the stewards added by signed records since. A malformed value falls back to the organiser alone."""
        if leaders == ANY:
            return cls(organiser, (), True)
        named: list[str] = []
        if isinstance(leaders, list) and all(isinstance(p, str) for p in leaders):
            try:
                named = [check_peer_id(p, "leaders[]") for p in leaders[:MAX_STEWARDS]]
            except ValueError:
                named = []
        order = list(dict.fromkeys([*(named or [organiser]), *added]))
        return cls(organiser, tuple(order), False)

    def may_lead(self, peer_id: str) -> bool:
        return self.any or peer_id in self.stewards

    def writers(self) -> tuple[str, ...] | None:
        """Who may store the leader's records (plans, beats) and the stewards records: the organiser and its
        stewards; None where the members elect (any member may come to lead)."""
        return None if self.any else tuple(sorted({self.organiser, *self.stewards}))

    def describe(self) -> str:
        return "any credited member (elected)" if self.any else f"{len(self.stewards)} steward(s)"


def waiting_line(policy: LeaderPolicy) -> str:
    """What ``peer status``, the dashboard and the log say while no steward is live."""
    n = len(policy.stewards)
    return f"waiting for a leader the organiser trusts: {n} steward{'s' if n != 1 else ''}, none live"
