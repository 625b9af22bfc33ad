/*
 * 8-float GNU C vectors and the e^x both C kernels of backend="cpu" use (paged_decode.c,
 * layer_ops.c): one AVX register with -march=native on x86, two SSE ones without.
 */
#ifndef PAGED_LIB_VEC_H
#define PAGED_LIB_VEC_H
#include <stdint.h>

/* 8 floats: one AVX register with -march=native on x86 (two SSE ones without); unaligned. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8 *)(p))
#define STORE(p, x) (*(v8 *)(p) = (x))

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* e^x, 8 lanes at once, for the softmax's x <= 0: Cephes' expf (x = n ln 2 + r, a degree-6
 * polynomial in r, then n added to the exponent bits), within about 2 ulp of expf; below
 * -87.3 (where e^x leaves the normal floats) the result is 0, and a NaN stays a NaN. */
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
static inline v8 exp_v8(v8 x) {
    const v8 lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const vi8 under = x < lo;                     /* lanes that underflow: 0 at the end */
    x = (v8)(((vi8)x & ~under) | ((vi8)lo & under));
    const v8 magic = x * 0.0f + 12582912.0f;     /* 1.5 * 2^23: adding it rounds to an int */
    const v8 n = (x * 1.44269504088896341f + magic) - magic;
    const v8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
    return (v8)((vi8)(p * (v8)bits) & ~under);
}

#endif
