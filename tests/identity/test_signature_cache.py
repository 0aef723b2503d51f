"""peer.identity.keys.CachingSignatureValidator: a DHT node skips the RSA check only for a record identical, byte
for byte, to one it verified; anything changed is checked again and refused, and refusals are never remembered."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from tasklet.peer.identity.keys import CachingSignatureValidator


@pytest.fixture
def rsa_checks(monkeypatch) -> list[DHTRecord]:
    """Every record that reaches hivemind's own (RSA) check."""
    seen: list[DHTRecord] = []
    original = RSASignatureValidator.validate

    def counting(self: RSASignatureValidator, record: DHTRecord) -> bool:
        seen.append(record)
        return original(self, record)

    monkeypatch.setattr(RSASignatureValidator, "validate", counting)
    return seen


def _signed(validator: CachingSignatureValidator, value: bytes, expiry: float = 1e9) -> DHTRecord:
    record = DHTRecord(key=b"run/peers", subkey=validator.local_public_key, value=value, expiration_time=expiry)
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_an_identical_record_skips_the_rsa_check_and_a_changed_one_is_refused(rsa_checks) -> None:
    validator = CachingSignatureValidator(RSAPrivateKey())
    good = _signed(validator, b"advert-1")
    assert validator.validate(good) and validator.validate(good)
    assert len(rsa_checks) == 1, "the second, identical record is accepted from the cache"
    forged_value = dataclasses.replace(good, value=good.value.replace(b"advert-1", b"advert-2", 1))
    longer_life = dataclasses.replace(good, expiration_time=good.expiration_time + 1)
    other_key = dataclasses.replace(good, key=b"run/plan")
    for forged in (forged_value, longer_life, other_key):
        assert not validator.validate(forged)
        assert not validator.validate(forged), "a refusal is not remembered as a success"
    assert len(rsa_checks) == 1 + 3 * 2, "every changed record went through the RSA check, every time"


def test_another_owners_record_is_checked_against_its_own_key(rsa_checks) -> None:
    ours, theirs = CachingSignatureValidator(RSAPrivateKey()), CachingSignatureValidator(RSAPrivateKey())
    record = _signed(theirs, b"advert")
    assert ours.validate(record)
    # the same value and signature claimed under our key (the owner tag is part of the subkey): refused
    stolen = dataclasses.replace(record, subkey=ours.local_public_key)
    assert not ours.validate(stolen)


def test_the_cache_is_bounded_and_forgets_the_least_recently_used(rsa_checks) -> None:
    validator = CachingSignatureValidator(RSAPrivateKey(), max_entries=2)
    a, b, c = (_signed(validator, v) for v in (b"a", b"b", b"c"))
    for record in (a, b, a, c):  # a used again before c arrives: b is the least recently used
        assert validator.validate(record)
    checked = len(rsa_checks)
    assert validator.validate(a) and validator.validate(c)
    assert len(rsa_checks) == checked, "a and c are still remembered"
    assert validator.validate(b)
    assert len(rsa_checks) == checked + 1, "b was forgotten and is verified again"
