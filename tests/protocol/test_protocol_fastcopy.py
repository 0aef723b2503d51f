"""The receiver's float32 copy-and-check in C (protocol/_copycheck.c via protocol.fastcopy).

It writes straight into a tensor's buffer with ctypes, so its bounds and its answers must be exactly those of
the numpy path: every byte copied whatever the data, NaN/inf found wherever they are (also in an element cut
across two calls), finite data never refused, and a bad offset refused before anything is written.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from tasklet.protocol import fastcopy


def test_built_wherever_a_c_compiler_exists() -> None:
    """`pip install` builds it as an optional extension: with a compiler present, missing means a broken build."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the numpy path is used (tests/protocol/test_protocol_message.py covers it)")
    assert fastcopy.AVAILABLE, "tasklet.protocol._copycheck was not built: run `pip install -e .` (scripts/setup.sh)"


needs_c = pytest.mark.skipif(not fastcopy.AVAILABLE, reason="tasklet.protocol._copycheck is not built here")


def _reference(dest: np.ndarray, at: int, src: np.ndarray, checked: int) -> int:
    dest[at : at + src.size] = src
    end = (at + src.size) & ~3
    values = dest[checked:end].view(np.float32)
    return end if bool(np.isfinite(values).all()) else fastcopy.NOT_FINITE


@needs_c
@pytest.mark.parametrize("size", [0, 1, 3, 4, 15, 16, 17, 63, 64, 65, 127, 1000, 4099, 1 << 20])
@pytest.mark.parametrize("at", [0, 1, 2, 3, 4, 13, 64, 4097])
def test_copies_every_byte_and_answers_like_numpy(size: int, at: int) -> None:
    rng = np.random.default_rng(size * 31 + at)
    # finite floats as they will sit in the buffer: the bytes before `at` arrived earlier, src is the rest
    whole = rng.standard_normal((at + size) // 4 + 1, dtype=np.float32).view(np.uint8)
    src = whole[at : at + size].copy()
    checked = at & ~3
    got, want = np.zeros(at + size + 8, np.uint8), np.zeros(at + size + 8, np.uint8)
    got[:at] = want[:at] = whole[:at]
    assert fastcopy.copy_check_f32(got, at, src, checked) == _reference(want, at, src, checked) == (at + size) & ~3
    assert np.array_equal(got, want)  # the bytes after the copied range untouched


@needs_c
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_finds_a_bad_value_anywhere_and_still_copies_everything(bad: float) -> None:
    n = 3000  # floats: a head, a streamed middle, a tail at most offsets
    for at in (0, 1, 2, 3, 8, 17):
        for where in (0, 1, 2, 5, n // 2, n - 2, n - 1):
            values = np.random.default_rng(where).standard_normal(n, dtype=np.float32)
            values[where] = bad
            data = values.view(np.uint8)
            dest = np.zeros(at + data.size, np.uint8)
            # the data lands at `at`: the float at dest offset 4k is what is checked, so place the values there
            src = np.zeros(data.size, np.uint8)
            shift = (-at) % 4
            src[shift:] = data[: data.size - shift]
            want = dest.copy()
            expected = _reference(want, at, src, at & ~3)
            assert fastcopy.copy_check_f32(dest, at, src, at & ~3) == expected
            assert np.array_equal(dest, want)
            whole = want[(at + 3) & ~3 :][: (want.size - ((at + 3) & ~3)) & ~3].view(np.float32)
            assert (expected == fastcopy.NOT_FINITE) == (not np.isfinite(whole).all())


@needs_c
def test_an_element_cut_across_two_calls_is_checked_when_it_completes() -> None:
    nan = np.array([math.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], np.float32).view(np.uint8)
    for cut in (1, 2, 3):
        dest = np.zeros(nan.size, np.uint8)
        first = fastcopy.copy_check_f32(dest, 0, nan[:cut].copy(), 0)
        assert first == 0  # nothing whole yet: nothing proven
        assert fastcopy.copy_check_f32(dest, cut, nan[cut:].copy(), first) == fastcopy.NOT_FINITE
        assert np.array_equal(dest, nan)


@needs_c
def test_huge_finite_values_are_finite() -> None:
    """The C check is exact (x * 0), so values whose sum would overflow are not mistaken for inf."""
    huge = np.full(4096, np.finfo(np.float32).max, np.float32).view(np.uint8)
    dest = np.empty(huge.size, np.uint8)
    assert fastcopy.copy_check_f32(dest, 0, huge, 0) == huge.size


@needs_c
def test_bad_bounds_raise_before_anything_is_written() -> None:
    dest = np.zeros(64, np.uint8)
    src = np.ones(16, np.uint8)
    for at, checked in ((49, 48), (-1, 0), (8, 12)):
        with pytest.raises(ValueError, match="bad arguments"):
            fastcopy.copy_check_f32(dest, at, src, checked)
    with pytest.raises(ValueError, match="bad arguments"):
        fastcopy.copy_check_f32(dest[::2], 0, src[:4], 0)  # not contiguous
    readonly = dest.copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="bad arguments"):
        fastcopy.copy_check_f32(readonly, 0, src, 0)
    assert not dest.any()
