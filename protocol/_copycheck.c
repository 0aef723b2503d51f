/* Copy received float32 bytes into a tensor's buffer and prove them finite in the same pass.
 *
 * Why C: the receiver's one remaining copy is memory-bound. Written in small cache-sized steps (what numpy can
 * do), every destination line is first read for ownership, then written; glibc's memcpy only switches to
 * non-temporal (streaming) stores for copies of hundreds of MiB. Here the destination is written with
 * streaming stores (the tensor is read much later, by then out of the cache anyway) and each value is checked
 * while it is in a register, which spares both the read-for-ownership and a second pass for the check.
 *
 * The check is exact: x * 0 is 0 for every finite x and NaN for NaN and +-inf, so the sum of x * 0 over the
 * data is 0 exactly when every element is finite (no overflow can make a finite tensor look otherwise).
 * Build without -ffast-math: it would fold x * 0 to 0.
 *
 * Loaded with ctypes (protocol/fastcopy.py), not imported: no Python API is used, so the GIL is released while
 * it runs. Built by setuptools as an optional extension; without it, protocol.message does the same in numpy.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* 1 when each of the `count` float32 values at p (any alignment) is finite. */
static int finite_f32(const uint8_t *p, size_t count) {
    float acc = 0.0f;
    for (size_t i = 0; i < count; i++) {
        float v;
        memcpy(&v, p + 4 * i, 4);
        acc += v * 0.0f;
    }
    return acc == 0.0f;
}

/* Copy n bytes from src to dst + at, then make sure every whole float32 element of dst in [checked, end) is
 * finite, end = (at + n) rounded down to whole elements; dst's start must be 4-byte aligned (elements start at
 * multiples of 4) and checked <= at. Everything is always copied. Returns end, or -1 when an element is NaN or
 * +-inf, or -2 when the arguments break those rules (nothing is written then). */
long long tasklet_copy_check_f32(uint8_t *dst, size_t at, const uint8_t *src, size_t n, size_t checked) {
    if (((uintptr_t)dst & 3) != 0 || checked > at) {
        return -2;
    }
    uint8_t *d = dst + at;
    size_t end = (at + n) & ~(size_t)3;
    size_t i = 0;
    int finite = 1;
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* plain stores until d + i is 16-byte aligned */
    if (head > n) {
        head = n;
    }
    memcpy(d, src, head);
    i = head;
    size_t streamed_from = at + i; /* a whole element unless n ended first: dst is 4-aligned, dst + at + i 16 */
    __m128 zero = _mm_setzero_ps();
    __m128 acc0 = zero, acc1 = zero, acc2 = zero, acc3 = zero;
    for (; i + 64 <= n; i += 64) {
        __m128 a = _mm_loadu_ps((const float *)(src + i));
        __m128 b = _mm_loadu_ps((const float *)(src + i + 16));
        __m128 c = _mm_loadu_ps((const float *)(src + i + 32));
        __m128 e = _mm_loadu_ps((const float *)(src + i + 48));
        _mm_stream_ps((float *)(d + i), a);
        _mm_stream_ps((float *)(d + i + 16), b);
        _mm_stream_ps((float *)(d + i + 32), c);
        _mm_stream_ps((float *)(d + i + 48), e);
        acc0 = _mm_add_ps(acc0, _mm_mul_ps(a, zero));
        acc1 = _mm_add_ps(acc1, _mm_mul_ps(b, zero));
        acc2 = _mm_add_ps(acc2, _mm_mul_ps(c, zero));
        acc3 = _mm_add_ps(acc3, _mm_mul_ps(e, zero));
    }
    for (; i + 16 <= n; i += 16) {
        __m128 a = _mm_loadu_ps((const float *)(src + i));
        _mm_stream_ps((float *)(d + i), a);
        acc0 = _mm_add_ps(acc0, _mm_mul_ps(a, zero));
    }
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before anyone reads the buffer */
    size_t streamed_to = at + i;
    memcpy(d + i, src + i, n - i);
    __m128 acc = _mm_add_ps(_mm_add_ps(acc0, acc1), _mm_add_ps(acc2, acc3));
    if (_mm_movemask_ps(_mm_cmpneq_ps(acc, zero)) != 0) { /* a NaN lane compares unequal too */
        finite = 0;
    }
    /* the elements outside the streamed middle: the head (and what an earlier call left unchecked), the tail */
    if (finite && streamed_from > checked) {
        size_t to = streamed_from < end ? streamed_from : end;
        if (to > checked) {
            finite = finite_f32(dst + checked, (to - checked) / 4);
        }
    }
    if (finite && end > streamed_to) { /* then the middle ran to a whole element: streamed_to is one */
        size_t from = streamed_to > checked ? streamed_to : checked;
        finite = finite_f32(dst + from, (end - from) / 4);
    }
#else
    memcpy(d, src, n);
    if (end > checked) {
        finite = finite_f32(dst + checked, (end - checked) / 4);
    }
#endif
    return finite ? (long long)end : -1;
}
