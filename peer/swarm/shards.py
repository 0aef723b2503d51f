"""The kinds of record every member writes, spread over more DHT keys as the swarm grows.

A key's entries travel whole in one find reply, which p2pd caps at 4 MiB, so a node holds at most 3 MiB under one
key (peer.swarm.records): one ``peers`` key fills at about 1,400 typical peers, or 266 of the largest honest
adverts. So ``peers`` and ``links`` (:data:`SHARDED`) are split, as far as the swarm needs, into up to
:data:`MAX_SHARDS` keys: shard 0 is the kind's own key (``run:peers``, all a small swarm ever uses), shard ``s`` is
``run:peers/s``. At *level* ``L`` (a power of two) a writer stores in shard ``hash(writer) mod L``.

A read goes level by level: shard 0, then, while the writers it has read would crowd a shard of the level it is at
(more than :data:`CROWDED_ENTRIES` of them with one ``hash mod L``: :func:`crowded`), the shards of the next level
(``L .. 2L-1``), up to :data:`MAX_SHARDS`; the level where it stopped is the one the reader then writes at.
(Counting writers by where they belong at the level, not entries by where they sit, lets entries left at a lower
level by writers that moved on, or put there by an attacker, send nobody deeper for long.) Every writer so lands
where readers look, no organiser or leader decides the layout, and a swarm of four peers reads one key as before. An
entry may sit in any shard its writer could reach at some level (``hash mod 2^k``, seven shards) and nowhere else
(:func:`allowed_shards`): the DHT node's validator refuses the rest, and the owner's signature binds the key, so
nobody moves another's entry.

What it holds (:func:`peers_at_limit`): with 64 shards, 13,000 peers of the largest honest advert before the fullest
shard refuses one, 74,000 of the typical; no reply ever passes the key budget. Costs and limits: a read of a
level-``L`` swarm is ``L`` gets (issued together); 129 free identities ground to one ``hash mod 64`` push every
reader to all 64 (a cost, bounded, not a loss).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable

SHARDED = frozenset({"peers", "links"})  # the kinds every member writes one entry of: they grow with the swarm
MAX_SHARDS = 64
CROWDED_ENTRIES = 128  # a shard holding more entries than this sends readers (and then writers) one level deeper
P2PD_REPLY_BYTES = 4 * 1024 * 1024
ENTRY_FRAMING_BYTES = 32  # msgpack's framing of one entry in a reply (subkey, value, expiry)
REPLY_OVERHEAD_BYTES = 4096  # a find reply besides its entries: the responder, its nearest peers, protobuf
HEADROOM_SD = 4.0  # the fullest of the shards is taken this many standard deviations above the mean


def writer_hash(peer_id: str) -> int:
    """A writer's place among the shards: 64 bits of the SHA-256 of its peer id (evenly spread whatever the id)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


def shard_of(peer_id: str, level: int) -> int:
    """The shard ``peer_id`` writes in at ``level`` (a power of two up to :data:`MAX_SHARDS`)."""
    return writer_hash(peer_id) % level


def crowded(writers: Iterable[str], level: int) -> bool:
    """Whether more than :data:`CROWDED_ENTRIES` of ``writers`` share a shard at ``level``."""
    counts = Counter(writer_hash(writer) % level for writer in writers)
    return bool(counts) and max(counts.values()) > CROWDED_ENTRIES


def level_suffix(level: int) -> bytes:
    """The subkey suffix of an entry written at ``level``: none at level 1, ``@L`` deeper (so readers know how deep
    the writers are, and an entry's shard is checked against its own level)."""
    return b"" if level == 1 else b"@%d" % level


def suffix_level(suffix: bytes) -> int | None:
    """The level a sharded entry's suffix names; None for anything that is not one (:func:`level_suffix`)."""
    if suffix == b"":
        return 1
    if not suffix.startswith(b"@") or not suffix[1:].isdigit() or len(suffix) > 4:
        return None
    level = int(suffix[1:])
    return level if 2 <= level <= MAX_SHARDS and level & (level - 1) == 0 else None


def write_level(writers: Iterable[str]) -> int:
    """The level at which ``writers`` crowd no shard (at most :data:`MAX_SHARDS`): where a writer who read them
    writes."""
    writers = list(writers)
    level = 1
    while level < MAX_SHARDS and crowded(writers, level):
        level *= 2
    return level


def shard_name(name: str, shard: int) -> str:
    """The key name of ``shard`` of kind ``name``: the kind's own name for shard 0, ``peers/5`` otherwise."""
    return name if shard == 0 else f"{name}/{shard}"


def key_names(name: str) -> tuple[tuple[str, int], ...]:
    """Every (key name, shard) of kind ``name`` a node may store: all shards of a sharded kind, else the one."""
    if name not in SHARDED:
        return ((name, 0),)
    return tuple((shard_name(name, s), s) for s in range(MAX_SHARDS))


def next_shards(level: int) -> range:
    """The shards a read adds when it goes from ``level`` to the next (those of index ``level .. 2*level-1``)."""
    return range(level, min(2 * level, MAX_SHARDS))


def peers_at_limit(entry_bytes: int, limit: int, shards: int = MAX_SHARDS) -> int:
    """The smallest swarm at which the fullest of ``shards`` keys would pass ``limit`` bytes, each peer writing
    one entry of ``entry_bytes`` (subkey and signed value) into the shard its id hashes to (the peers per shard
    are binomial; the fullest is taken :data:`HEADROOM_SD` standard deviations above the mean). With the key
    budget as ``limit`` this is where a shard starts refusing honest entries; with p2pd's reply limit, where a
    reply would pass it were there no budget."""
    per_key = (limit - REPLY_OVERHEAD_BYTES) // (entry_bytes + ENTRY_FRAMING_BYTES)
    p = 1.0 / shards

    def fullest(peers: int) -> float:
        return peers * p + HEADROOM_SD * math.sqrt(peers * p * (1.0 - p))

    low, high = 0, 1
    while fullest(high) <= per_key:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fullest(middle) <= per_key else (low, middle)
    return high
