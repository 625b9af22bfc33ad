/*
 * The small steps of a decoder layer on a CPU, each one pass over its rows, for
 * backend="cpu" (loaded by paged_lib/kernels/cpu_layer.py, built into one library with
 * paged_decode.c).
 *
 * In PyTorch each of these steps is several operations (RMSNorm: square, mean, add,
 * rsqrt, two products; RoPE: two slices, a negation, a concatenation, two products, a
 * sum; then a copy per cache), each writing a temporary. In a decode step the rows are
 * few (one per sequence) and every linear map before them has just streamed megabytes of
 * weights through the caches, so those temporaries are written to cold memory: measured
 * on SmolLM2 at batch 8, an RMSNorm took about 40 us inside the model against 9 us alone.
 * Here each step reads its rows once and writes its result once.
 *
 * The arithmetic is PyTorch's, in float32, in the same order within each element
 * (x * cos + rotated * sin; x * rsqrt(mean(x^2) + eps) * w; x / (1 + e^-x) * up); sums
 * over a row are taken 8 lanes at a time, so a norm may differ from torch's in the last
 * bit or two (as torch's own vectorised sum differs from a loop).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "team.h"
#include "vec.h"

/* sum of x[i]^2, i < n: 8 lanes at a time, then the tail */
static float sum_squares(const float *x, int n) {
    v8 acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 v = LOAD(x + i);
        acc += v * v;
    }
    float s = hsum(acc);
    for (; i < n; ++i) s += x[i] * x[i];
    return s;
}

static void norm_row(const float *x, const float *w, float *out, int dim, float eps) {
    const float r = 1.0f / sqrtf(sum_squares(x, dim) / (float)dim + eps);
    for (int i = 0; i < dim; ++i) out[i] = (x[i] * r) * w[i];
}

/* The norms and SwiGLU's activation share their rows out between `threads` threads of the
 * calling thread's OpenMP team (PyTorch's, see paged_decode.c) from NORM_PARALLEL and
 * SILU_PARALLEL output floats; fewer rows stay on one thread, as a team's start costs a
 * few microseconds. Measured with SmolLM2's sizes, two threads (2026-12-07): the
 * activation (e^x for each float) took 7.2 us on one thread and 5.5 on two at 8 rows, 2.0
 * and 2.7 at one; the residual add and norm 4.0 and 4.4 us at 32 rows, 6.5 and 5.5 at 64,
 * 124 and 69 at 1,219 (a prefill). Each row is computed alone, so the results are the
 * same on any number of threads. */
#define NORM_PARALLEL (32 * 1024)
#define SILU_PARALLEL (8 * 1024)

/* Each step below has a _team form, whose rows are shared out between the threads of the
 * enclosing OpenMP team (all on the calling thread outside one; decode_layer.c runs them
 * inside its team), and a _rows form that starts a team of `threads` for enough rows. */

/* out = x / rms(x) * w, row by row ([rows, dim], contiguous). */
static void rms_norm_team(const float *x, const float *w, float *out, int rows, int dim,
                          float eps) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r)
        norm_row(x + (int64_t)r * dim, w, out + (int64_t)r * dim, dim, eps);
}

void rms_norm_rows(const float *x, const float *w, float *out, int rows, int dim, float eps,
                   int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if ((int64_t)rows * dim >= NORM_PARALLEL)
    rms_norm_team(x, w, out, rows, dim, eps);
}

/* The residual step: sum = x + h, then out = sum / rms(sum) * w (sum may be x itself). */
void add_rms_norm_team(const float *x, const float *h, const float *w, float *sum,
                       float *out, int rows, int dim, float eps) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
        const int64_t o = (int64_t)r * dim;
        for (int i = 0; i < dim; ++i) sum[o + i] = x[o + i] + h[o + i];
        norm_row(sum + o, w, out + o, dim, eps);
    }
}

void add_rms_norm_rows(const float *x, const float *h, const float *w, float *sum, float *out,
                       int rows, int dim, float eps, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if ((int64_t)rows * dim >= NORM_PARALLEL)
    add_rms_norm_team(x, h, w, sum, out, rows, dim, eps);
}

/* One head's rotation ("rotate half": pair (i, i + d/2)), from src to dst. Each product
 * rounded before the sum, as torch's two multiplications and an addition (no fused
 * multiply-add: -march=native would otherwise contract them). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void rotate(const float *src, const float *c, const float *s, float *dst, int d) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int half = d / 2;
    for (int i = 0; i < half; ++i) {
        const float a = src[i] * c[i], b = -src[i + half] * s[i];
        dst[i] = a + b;
    }
    for (int i = half; i < d; ++i) {
        const float a = src[i] * c[i], b = src[i - half] * s[i];
        dst[i] = a + b;
    }
}

/* RoPE and the cache write of one step's tokens. Row r of qkv ([rows, (heads + 2 *
 * kv_heads) * d], contiguous) holds the token's query heads, then its key heads, then its
 * value heads. Each query head is rotated into q_out ([rows, heads, d]); each key head is
 * rotated straight into its cache slot, each value head copied into its: the caches are
 * [slots, kv_heads, d] contiguous (blocks of slots flattened), and slots[r] is a slot of
 * the pool (checked by the caller). cos and sin are [rows, d]. */
void rope_write_team(const float *qkv, const float *cos_, const float *sin_,
                     const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                     int rows, int heads, int kv_heads, int d) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d, kv = (int64_t)kv_heads * d;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float *row = qkv + r * width, *c = cos_ + (int64_t)r * d,
                    *s = sin_ + (int64_t)r * d;
        for (int h = 0; h < heads; ++h)
            rotate(row + (int64_t)h * d, c, s, q_out + ((int64_t)r * heads + h) * d, d);
        float *k = k_cache + slots[r] * kv;
        for (int h = 0; h < kv_heads; ++h)
            rotate(row + (int64_t)(heads + h) * d, c, s, k + (int64_t)h * d, d);
        memcpy(v_cache + slots[r] * kv, row + (int64_t)heads * d + kv, sizeof(float) * kv);
    }
}

/* On the calling thread: a step's few rows are less work than a team's start. */
void rope_write_rows(const float *qkv, const float *cos_, const float *sin_,
                     const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                     int rows, int heads, int kv_heads, int d) {
    rope_write_team(qkv, cos_, sin_, slots, q_out, k_cache, v_cache, rows, heads, kv_heads, d);
}

/* SwiGLU's middle: out = silu(gate) * up, where row r of gate_up ([rows, 2 * inter]) is
 * the gate's inter columns, then up's. silu(x) = x / (1 + e^-x), with e^-|x| only (it
 * never overflows): x / (1 + t) for x >= 0, x * t / (1 + t) below, t = e^-|x|. */
void silu_mul_team(const float *gate_up, float *out, int rows, int inter) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        float *o = out + (int64_t)r * inter;
        int i = 0;
        const v8 zero = {0}, one = zero + 1.0f;
        for (; i + 8 <= inter; i += 8) {
            const v8 x = LOAD(g + i);
            const vi8 neg = x < zero;
            const v8 minus_abs = (v8)(((vi8)x & neg) | ((vi8)(-x) & ~neg));
            const v8 t = exp_v8(minus_abs);
            const v8 num = (v8)(((vi8)(x * t) & neg) | ((vi8)x & ~neg));
            STORE(o + i, num / (one + t) * LOAD(u + i));
        }
        for (; i < inter; ++i) {
            const float x = g[i], t = expf(-fabsf(x));
            o[i] = (x >= 0.0f ? x : x * t) / (1.0f + t) * u[i];
        }
    }
}

void silu_mul_rows(const float *gate_up, float *out, int rows, int inter, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if ((int64_t)rows * inter >= SILU_PARALLEL)
    silu_mul_team(gate_up, out, rows, inter);
}
