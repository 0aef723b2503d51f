"""Fetch grants: the coordinator's signed word that a peer may read a stage's state from another.

Why: a worker serves its stage's state only to a peer its plan gives those layers. During a re-plan the
source may be left out of the new plan (it never hears of it) while a newcomer must fetch from it. The
coordinator therefore signs, with its identity key, (run, epoch, fetching peer, layers); the fetcher sends the
grant with its request, and the source checks the signature against the certificate of a peer it accepts
control from (its plan's coordinator, the elected leader). A grant names the fetcher, so nobody else can use it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509 import load_pem_x509_certificate

from tasklet.peer.net.tls import TlsContext
from tasklet.protocol.errors import BadMessage


@dataclass(frozen=True)
class Grant:
    run_id: str
    epoch: int
    peer: str  # the peer id that may fetch
    layers: tuple[int, int]
    signer: str  # the coordinator's peer id

    def payload(self) -> bytes:
        body = [self.run_id, self.epoch, self.peer, list(self.layers), self.signer]
        return json.dumps(body, separators=(",", ":")).encode()


def sign_grant(tls: TlsContext, run_id: str, epoch: int, peer: str, layers: tuple[int, int]) -> str:
    grant = Grant(run_id, epoch, peer, (int(layers[0]), int(layers[1])), tls.peer_id)
    key = tls.identity.private_key._private_key
    sig = key.sign(grant.payload(), padding.PKCS1v15(), hashes.SHA256())
    return json.dumps({"g": json.loads(grant.payload()), "sig": base64.b64encode(sig).decode()})


def read_grant(text: str, tls: TlsContext) -> Grant:
    """Parse a grant and check its signature against the signer's trusted certificate (BadMessage if not)."""
    try:
        outer = json.loads(text)
        run_id, epoch, peer, layers, signer = outer["g"]
        grant = Grant(str(run_id), int(epoch), str(peer), (int(layers[0]), int(layers[1])), str(signer))
        sig = base64.b64decode(outer["sig"], validate=True)
    except (ValueError, TypeError, KeyError, IndexError):
        raise BadMessage("meta.grant", "not a fetch grant") from None
    pem = tls.trust.certificate(grant.signer)
    if pem is None:
        raise BadMessage("meta.grant", f"signed by peer {grant.signer}, whose certificate this peer does not trust")
    public = load_pem_x509_certificate(pem).public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    try:
        public.verify(sig, grant.payload(), padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise BadMessage("meta.grant", "the signature does not match its signer") from None
    return grant
