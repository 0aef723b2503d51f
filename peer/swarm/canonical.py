"""The canonical bytes of a record's JSON-like payload: what seals and signatures are computed over.

A leaf module (nothing of ours imported) so that records, adverts and the charter can all use it.
"""

from __future__ import annotations

import json


def canonical_json(payload: object) -> bytes:
    """Deterministic bytes of a JSON-like value; ValueError for anything else (bytes, NaN, sets...)."""
    try:
        return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise ValueError(f"payload is not plain JSON data: {error}") from error
