"""The model-family registry: every kind of model a run can train, registered here and nowhere else.

A run record names its model's family by the ``"kind"`` of the model dict (none: the byte GPT); code that holds a
spec finds its family with :func:`family_of`. Nothing else in the peer asks a spec what type it is. A new decoder
family is one module beside these (a :class:`ModelFamily` subclass and its spec) and one :func:`register` line
at the end of this file (docs/extending.md, "A model family").
"""

from __future__ import annotations

from typing import Any

from tasklet.peer.compute.family.base import FamilyError, ModelFamily, ModelMismatchError, ModelSpec
from tasklet.peer.compute.family.gpt import GPTFamily
from tasklet.peer.compute.family.hf import HFFamily

__all__ = ["FamilyError", "ModelFamily", "ModelMismatchError", "ModelSpec", "family_by_kind", "family_of", "kinds",
           "model_from_config", "model_from_dict", "model_to_dict", "register", "unregister"]

DEFAULT_KIND = "gpt"  # the kind of a model dict that names none (records written before families had kinds)

_FAMILIES: dict[str, ModelFamily] = {}


def register(new: ModelFamily) -> ModelFamily:
    """Add ``new`` under its kind; a kind registered twice is an error (two families cannot share a record)."""
    if not isinstance(new.kind, str) or not new.kind:
        raise FamilyError(f"a model family needs a kind name, got {new.kind!r}")
    if new.kind in _FAMILIES:
        raise FamilyError(f"model family {new.kind!r} is registered already")
    _FAMILIES[new.kind] = new
    return new


def unregister(kind: str) -> None:
    """Remove the family of ``kind`` (a test's own family, after the test)."""
    _FAMILIES.pop(kind, None)


def kinds() -> list[str]:
    """The registered kinds, in registration order."""
    return list(_FAMILIES)


def family_by_kind(kind: str) -> ModelFamily:
    """The family of ``kind``, or a :class:`FamilyError` naming it and the known ones."""
    try:
        return _FAMILIES[kind]
    except (KeyError, TypeError):
        raise FamilyError(f"model.kind: unknown model family {kind!r} (known: {', '.join(_FAMILIES)})") from None


def family_of(spec: Any) -> ModelFamily:
    """The family whose specs ``spec`` is one of, or a :class:`FamilyError` naming its type."""
    for f in _FAMILIES.values():
        if isinstance(spec, f.spec_type):
            return f
    raise FamilyError(f"model: a {type(spec).__name__} is no registered family's spec (known: {', '.join(_FAMILIES)})")


def model_from_dict(data: dict[str, Any]) -> ModelSpec:
    """The spec of a run record's model dict, by its kind."""
    return family_by_kind(data.get("kind", DEFAULT_KIND)).from_dict(data)


def model_to_dict(spec: Any) -> dict[str, Any]:
    """The JSON form of ``spec`` that :func:`model_from_dict` reads back."""
    return family_of(spec).to_dict(spec)


def model_from_config(section: Any, seed: int, tie: bool) -> ModelSpec:
    """The spec a run file's ``[model]`` section names. The family registered last is asked first, so a new
    family can claim its names before the general ones (the Hugging Face family takes any ``config``, the byte GPT
    an empty one)."""
    for f in reversed(_FAMILIES.values()):
        spec = f.from_config(section, seed, tie)
        if spec is not None:
            return spec
    raise FamilyError(f"[model]: no model family takes config {section.config!r}")


register(GPTFamily())
register(HFFamily())
