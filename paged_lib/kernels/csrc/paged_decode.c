/*
 * Paged decode attention on a CPU, in one pass over each sequence's blocks.
 *
 * The C twin of the Triton decode kernel (paged_lib/kernels/triton_decode.py), loaded by
 * paged_lib/kernels/cpu_decode.py. For each KV head of a sequence, the `group` query
 * heads that share it are attended together, so each cached K and V row
 * is read once, straight from its block (no gather copy), and only the rows below the
 * sequence's length are touched. The softmax is the online one of chapter 04: per block,
 * the scores of its tokens, a new running max, the old sums rescaled, the block's values
 * added in.
 *
 * Threads: the caller (Python) runs paged_decode() on several threads at once, each with
 * the same arguments; they share `next_item`, a counter each thread takes its next work
 * item from, so a thread that drew short sequences simply takes more of them. An item is
 * a sequence and some of its KV heads (all of them unless there are too few sequences
 * to keep the threads busy). ctypes
 * releases the GIL during the call. Built with -fopenmp (only where PyTorch's own
 * runtime is GNU libgomp, so the loader hands this file that same runtime), the file
 * also has paged_decode_team(): the same loop on the calling thread's OpenMP team, i.e.
 * PyTorch's own threads, which are still spinning from the last matmul, instead of
 * Python threads that would compete with them for the cores. Vectors: GNU C vector
 * types of 8 floats (AVX2 with -march=native), and of 16 for the values where the compiler
 * targets AVX-512.
 *
 * Caches: element (block, token, kv_head, d) sits at
 *   block * stride_block + token * stride_token + kv_head * stride_head + d
 * (elements), in float32, float16 or bfloat16 (`kind`); q and out are float32,
 * [num_seqs, num_heads, head_dim] contiguous. A sequence of length 0 gets zeros.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_F16 = 1, KIND_BF16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) u = sign | 0x7f800000u | (man << 13); /* inf, nan */
    else u = sign | ((exp + 112u) << 23) | (man << 13);
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Row `offset` (in elements) of a cache as float32: the cache itself for float32, else
 * converted into `buf`. */
static inline const float *row_f32(const void *cache, int64_t offset, int kind, int n,
                                   float *buf) {
    if (kind == KIND_F32) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    if (kind == KIND_BF16)
        for (int i = 0; i < n; ++i) buf[i] = bf16_to_f32(src[i]);
    else
        for (int i = 0; i < n; ++i) buf[i] = f16_to_f32(src[i]);
    return buf;
}

#include "team.h"
#include "vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* out[g] = sum of the 8 lanes of acc[g], g < n (n <= 4). */
static inline __attribute__((always_inline)) void hsum_upto4(const v8 *acc, int n, float *out) {
#if defined(__AVX__)
    const v8 zero = {0};
    const __m256 a = (__m256)acc[0], b = n > 1 ? (__m256)acc[1] : (__m256)zero,
                 c = n > 2 ? (__m256)acc[2] : (__m256)zero,
                 d = n > 3 ? (__m256)acc[3] : (__m256)zero;
    /* Two horizontal adds leave each head's two half-sums in one lane of each half. */
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    float sums[4];
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(abcd),
                                   _mm256_extractf128_ps(abcd, 1)));
    for (int g = 0; g < n; ++g) out[g] = sums[g];
#else
    for (int g = 0; g < n; ++g) out[g] = hsum(acc[g]);
#endif
}

/* Scores of `n` (1-4) query heads against two K rows at once: each chunk of q is loaded
 * once for both rows, and the 2n accumulators are 2n independent FMA chains. */
static inline __attribute__((always_inline)) void scores2_upto4(
        const float *q, const float *k0, const float *k1, int n, int head_dim, float *out0,
        float *out1) {
    v8 a[4] = {{0}}, b[4] = {{0}};
    for (int c = 0; c < head_dim; c += 8) {
        const v8 x0 = LOAD(k0 + c), x1 = LOAD(k1 + c);
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) {
            const v8 qg = LOAD(q + g * head_dim + c);
            a[g] += qg * x0;
            b[g] += qg * x1;
        }
    }
    hsum_upto4(a, n, out0);
    hsum_upto4(b, n, out1);
}

/* acc[g] += sum_t w[t][g] * v[t] for `n` (1-4) heads, 16 columns at a time: each column
 * chunk of the accumulators is loaded and stored once per block, not once per token. */
static inline __attribute__((always_inline)) void values_upto4(
        float *acc, const float *w, int group, const float *const *v, int tokens, int n,
        int head_dim) {
    int c = 0;
    for (; c + 16 <= head_dim; c += 16) {
        v8 a[4], b[4];
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) {
            a[g] = LOAD(acc + g * head_dim + c);
            b[g] = LOAD(acc + g * head_dim + c + 8);
        }
        for (int t = 0; t < tokens; ++t) {
            const v8 v0 = LOAD(v[t] + c), v1 = LOAD(v[t] + c + 8);
#pragma GCC unroll 4
            for (int g = 0; g < n; ++g) {
                a[g] += w[t * group + g] * v0;
                b[g] += w[t * group + g] * v1;
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) {
            STORE(acc + g * head_dim + c, a[g]);
            STORE(acc + g * head_dim + c + 8, b[g]);
        }
    }
    if (c < head_dim) {
        v8 a[4];
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) a[g] = LOAD(acc + g * head_dim + c);
        for (int t = 0; t < tokens; ++t) {
            const v8 v0 = LOAD(v[t] + c);
#pragma GCC unroll 4
            for (int g = 0; g < n; ++g) a[g] += w[t * group + g] * v0;
        }
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) STORE(acc + g * head_dim + c, a[g]);
    }
}

#if defined(__AVX512F__)
/* values_upto4 with 16-float vectors (one AVX-512 register), 32 columns at a time, for
 * head sizes that are a multiple of 32: half the loads and multiply-adds of 8-float
 * vectors, and still two independent chains per head (measured with SmolLM2's shapes, two
 * threads: 163 -> 143 us a layer at 32 sequences of 130 tokens in cache, 250 from memory;
 * one 16-float chain per head gained nothing, and neither did the scores in 16 floats). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline __attribute__((always_inline)) void values16_upto4(
        float *acc, const float *w, int group, const float *const *v, int tokens, int n,
        int head_dim) {
    for (int c = 0; c < head_dim; c += 32) {
        v16 a[4], b[4];
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) {
            a[g] = *(const v16 *)(acc + g * head_dim + c);
            b[g] = *(const v16 *)(acc + g * head_dim + c + 16);
        }
        for (int t = 0; t < tokens; ++t) {
            const v16 x = *(const v16 *)(v[t] + c), y = *(const v16 *)(v[t] + c + 16);
#pragma GCC unroll 4
            for (int g = 0; g < n; ++g) {
                a[g] += w[t * group + g] * x;
                b[g] += w[t * group + g] * y;
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < n; ++g) {
            *(v16 *)(acc + g * head_dim + c) = a[g];
            *(v16 *)(acc + g * head_dim + c + 16) = b[g];
        }
    }
}
#endif

/* The two steps with `n` a constant in each case, so the compiler unrolls the head loops
 * and keeps the accumulators in registers. */
static void scores2_vec(const float *q, const float *k0, const float *k1, int n,
                        int head_dim, float *out0, float *out1) {
    switch (n) {
    case 4: scores2_upto4(q, k0, k1, 4, head_dim, out0, out1); break;
    case 3: scores2_upto4(q, k0, k1, 3, head_dim, out0, out1); break;
    case 2: scores2_upto4(q, k0, k1, 2, head_dim, out0, out1); break;
    default: scores2_upto4(q, k0, k1, 1, head_dim, out0, out1); break;
    }
}

static void values_vec(float *acc, const float *w, int group, const float *const *v,
                       int tokens, int n, int head_dim) {
#if defined(__AVX512F__)
    if (head_dim % 32 == 0) {
        switch (n) {
        case 4: values16_upto4(acc, w, group, v, tokens, 4, head_dim); return;
        case 3: values16_upto4(acc, w, group, v, tokens, 3, head_dim); return;
        case 2: values16_upto4(acc, w, group, v, tokens, 2, head_dim); return;
        default: values16_upto4(acc, w, group, v, tokens, 1, head_dim); return;
        }
    }
#endif
    switch (n) {
    case 4: values_upto4(acc, w, group, v, tokens, 4, head_dim); break;
    case 3: values_upto4(acc, w, group, v, tokens, 3, head_dim); break;
    case 2: values_upto4(acc, w, group, v, tokens, 2, head_dim); break;
    default: values_upto4(acc, w, group, v, tokens, 1, head_dim); break;
    }
}

/* The same two steps for any head size (not a multiple of 8), one float at a time. */
static void scores_any(const float *q, const float *k, int n, int head_dim, float *out) {
    for (int g = 0; g < n; ++g) {
        float s = 0.0f;
        for (int i = 0; i < head_dim; ++i) s += q[g * head_dim + i] * k[i];
        out[g] = s;
    }
}

static void values_any(float *acc, const float *w, int group, const float *const *v,
                       int tokens, int n, int head_dim) {
    for (int t = 0; t < tokens; ++t)
        for (int g = 0; g < n; ++g)
            for (int i = 0; i < head_dim; ++i) acc[g * head_dim + i] += w[t * group + g] * v[t][i];
}

/* Ask for a block's K and V rows of KV heads kvh0 .. kvh0 + kv_heads - 1 (`tokens` rows of
 * `span` bytes each, `esize` bytes an element) to be brought into the cache. Blocks sit
 * anywhere in the pool, so the hardware prefetcher, which follows one address stream, starts
 * cold at each; asked one block ahead, memory serves the next block while this one is
 * computed (measured here: one thread streaming 8 sequences' blocks scattered over a 490 MB
 * pool went from 5.4 to 7.9 GB/s; two blocks ahead gained nothing more). Used for a
 * sequence's first block; the later ones are asked for row by row (prefetch_rows). */
static inline void prefetch_block(const void *k_cache, const void *v_cache, int64_t block,
                                  int tokens, int kvh0, int64_t stride_block,
                                  int64_t stride_token, int64_t stride_head, int esize,
                                  int64_t span) {
    const char *k = (const char *)k_cache + (block * stride_block + kvh0 * stride_head) * esize;
    const char *v = (const char *)v_cache + (block * stride_block + kvh0 * stride_head) * esize;
    for (int t = 0; t < tokens; ++t)
        for (int64_t c = 0; c < span; c += 64) { /* one cache line at a time */
            __builtin_prefetch(k + t * stride_token * esize + c, 0, 3);
            __builtin_prefetch(v + t * stride_token * esize + c, 0, 3);
        }
}

/* The next block's K and V rows t0 .. t1 of one KV head (`bytes` each), asked for while this
 * block's same rows are computed. Asked all at once at the start of a block (prefetch_block),
 * a block's hundreds of lines overflow the few requests a core keeps in flight and most are
 * dropped; spread over the block's work they arrive in time (measured, SmolLM2's shapes, 30
 * layers' caches, two threads: a batch of 32 sequences of 130 tokens went from 420 to 255-300
 * us a layer, 8 sequences from 150 to 75-105).
 * That batch still reads its K/V at about 27 GB/s, where a loop that only reads the same
 * blocks (prefetched the same way) reads them at 43-52 GB/s and the work alone, in cache,
 * takes 131 us: here memory and arithmetic add up instead of overlapping. Measured on a
 * 2-core AMD EPYC (2026-12-07), none of these changed it: rows two or three blocks ahead,
 * every KV head's rows of a token in turn, V's rows asked for in the values loop, one line
 * in two (the hardware fetches no neighbour), prefetcht1/t2, 2 MB pages (7% in isolation,
 * 1% in a step); with no prefetch at all it took twice as long. touch_block, below, takes
 * back a part of the difference. */
static inline void prefetch_rows(const char *k, const char *v, int t0, int t1,
                                 int64_t row_bytes, int bytes) {
    for (int t = t0; t <= t1; ++t)
        for (int c = 0; c < bytes; c += 64) {
            __builtin_prefetch(k + t * row_bytes + c, 0, 3);
            __builtin_prefetch(v + t * row_bytes + c, 0, 3);
        }
}

/* Load every whole cache line of a block's K and V rows of KV heads kvh0 .. (the same rows
 * prefetch_block asks for) before the block is computed on. Most lines are there already,
 * asked for a block ahead (prefetch_rows); those that are not come in together here, many
 * at once, instead of one by one as the arithmetic reaches each, each then holding the
 * core's work up. Measured with SmolLM2's shapes on a 2-core AMD EPYC (2026-12-07), two
 * threads: alone, on 30 layers' caches with blocks in random order, 32 sequences of 130-150
 * tokens went from 230-250 to 203-226 us a layer (in the last level cache, 126-138 became
 * 136-150); a whole decode step of 32 sequences, old and new kernel in turn in one process,
 * from 27.3-27.8 to 26.6-27.0 ms with each sequence's blocks shuffled in the pool (26.5-27.0
 * to 26.2-26.6 in order), 8 sequences 13.9-15.0 to 13.7-14.5, one the same. A load of one
 * byte per line gained little (235 against 239 us). Returns the lines' bits OR-ed together,
 * which the caller keeps, so that the compiler keeps the loads.
 * What is left is memory and arithmetic taking turns. Measured the same way (2026-12-07,
 * 32 sequences, two threads), loading each block's lines with no arithmetic took 97 us a
 * layer with blocks in order and 152-156 shuffled, the arithmetic alone from the last level
 * cache 121-153, and this kernel from memory 184-209 and 191-229: the reads hide under the
 * arithmetic only in part. A kernel whose arithmetic took 104 us in cache (a block's 16
 * scores of a head added up into one 16-float vector) was no faster from memory (192-200
 * against 184-188 in order) nor in a whole step (28.21 against 28.14 ms, medians); nor was
 * asking for the block after next into L2 (prefetcht1/t2), or for the first lines of each
 * 4 KB page of the next block. */
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
static inline int32_t touch_block(const void *k_cache, const void *v_cache, int64_t block,
                                  int tokens, int kvh0, int64_t stride_block,
                                  int64_t stride_token, int64_t stride_head, int esize,
                                  int64_t span) {
    const char *k = (const char *)k_cache + (block * stride_block + kvh0 * stride_head) * esize;
    const char *v = (const char *)v_cache + (block * stride_block + kvh0 * stride_head) * esize;
    vi16 a = {0}, b = {0};
    for (int t = 0; t < tokens; ++t)
        for (int64_t c = 0; c + 64 <= span; c += 64) { /* whole lines inside the rows only */
            a |= *(const vi16 *)(k + t * stride_token * esize + c);
            b |= *(const vi16 *)(v + t * stride_token * esize + c);
        }
    a |= b;
    int32_t bits = 0;
    for (int i = 0; i < 16; ++i) bits |= a[i];
    return bits;
}

/* Attention of KV heads kvh0 .. kvh0 + kv_heads - 1 of sequence `s` (each with its
 * `group` query heads). Block by block, every KV head of the item is done before the
 * next block: a block's rows for all KV heads are adjacent in memory (the cache is
 * [block, token, kv_head, d]), so the item streams through whole blocks instead of
 * touching one 4 KB page per token per head. */
static inline __attribute__((always_inline)) void attend_item_group(
                        int s, int kvh0, int kv_heads, const float *q, const void *k_cache,
                        const void *v_cache, int kind, const int32_t *block_tables,
                        const int32_t *seq_lens, float *out, int num_heads, int group,
                        int head_dim, int block_size, int64_t table_width,
                        int64_t stride_block, int64_t stride_token, int64_t stride_head,
                        float scale, int after) {
    const int heads = kv_heads * group; /* query heads of this item, adjacent in q and out */
    const int64_t first_row = ((int64_t)s * num_heads + (int64_t)kvh0 * group) * head_dim;
    float *acc = out + first_row; /* accumulate in place */
    const int len = seq_lens[s];
    memset(acc, 0, sizeof(float) * (size_t)heads * (size_t)head_dim);
    if (len <= 0) return;

    const int vec = head_dim % 8 == 0;
    /* Converted rows (float16/bfloat16 caches) land in buf: one row per token of a block. */
    float qs[heads * head_dim], m[heads], l[heads], w[block_size * group],
          shift[block_size * group];
    float buf[kind == KIND_F32 ? 1 : block_size * head_dim];
    const float *rows[block_size];
    for (int i = 0; i < heads * head_dim; ++i) qs[i] = q[first_row + i] * scale;
    for (int h = 0; h < heads; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const int32_t *table = block_tables + (int64_t)s * table_width;
    const int num_blocks = (len + block_size - 1) / block_size;
    const int esize = kind == KIND_F32 ? 4 : 2;
    const int64_t span = (int64_t)kv_heads * head_dim * esize; /* a token's rows, in bytes */
    int32_t touched = 0; /* touch_block's bits, kept below */
    prefetch_block(k_cache, v_cache, table[0], len < block_size ? len : block_size, kvh0,
                   stride_block, stride_token, stride_head, esize, span);
    for (int b = 0; b < num_blocks; ++b) {
        const int tokens = len - b * block_size < block_size ? len - b * block_size
                                                             : block_size;
        /* rows of the next block (0 if none): this sequence's, or after its last block the
         * first of sequence `after`, the item this thread will likely take next (else its
         * first block arrives cold: measured with SmolLM2's shapes, 30 layers' caches, two
         * threads, 32 sequences went from 261-263 to 248-250 us a layer, 8 from 52-55 to
         * 49-51) */
        int next = b + 1 < num_blocks ? len - (b + 1) * block_size : 0;
        int64_t next_block = b + 1 < num_blocks ? table[b + 1] : 0;
        if (b + 1 == num_blocks && after >= 0) {
            next = seq_lens[after];
            next_block = block_tables[(int64_t)after * table_width];
        }
        const int next_tokens = next < block_size ? (next > 0 ? next : 0) : block_size;
        touched |= touch_block(k_cache, v_cache, table[b], tokens, kvh0, stride_block,
                               stride_token, stride_head, esize, span);
        for (int j = 0; j < kv_heads; ++j) {
            const int64_t base = (int64_t)table[b] * stride_block
                                 + (int64_t)(kvh0 + j) * stride_head;
            const float *qj = qs + (int64_t)j * group * head_dim;
            float *accj = acc + (int64_t)j * group * head_dim, *mj = m + j * group,
                  *lj = l + j * group;
            /* Scores: each K row is read once for all `group` heads (four at a time), two
             * rows per pass; an odd last row is paired with itself (the two results are
             * the same numbers, written to the same place). */
            const int64_t next_base = next_tokens ? ((int64_t)next_block * stride_block
                                                     + (int64_t)(kvh0 + j) * stride_head) * esize
                                                  : 0;
            for (int t = 0; t < tokens; t += 2) {
                const int t1 = t + 1 < tokens ? t + 1 : t;
                if (t < next_tokens)
                    prefetch_rows((const char *)k_cache + next_base,
                                  (const char *)v_cache + next_base, t,
                                  t + 1 < next_tokens ? t + 1 : t, stride_token * esize,
                                  head_dim * esize);
                const float *k0 = row_f32(k_cache, base + t * stride_token, kind, head_dim,
                                          buf + (kind == KIND_F32 ? 0 : t * head_dim));
                const float *k1 = row_f32(k_cache, base + t1 * stride_token, kind, head_dim,
                                          buf + (kind == KIND_F32 ? 0 : t1 * head_dim));
                for (int g = 0; g < group; g += 4) {
                    const int n = group - g < 4 ? group - g : 4;
                    float *out0 = w + t * group + g, *out1 = w + t1 * group + g;
                    if (vec) {
                        scores2_vec(qj + g * head_dim, k0, k1, n, head_dim, out0, out1);
                    } else {
                        scores_any(qj + g * head_dim, k0, n, head_dim, out0);
                        scores_any(qj + g * head_dim, k1, n, head_dim, out1);
                    }
                }
            }
            /* Online softmax: new max, old sums rescaled, scores turned into weights. */
            for (int g = 0; g < group; ++g) {
                float block_max = -INFINITY;
                for (int t = 0; t < tokens; ++t)
                    if (w[t * group + g] > block_max) block_max = w[t * group + g];
                const float m_new = block_max > mj[g] ? block_max : mj[g];
                if (m_new > mj[g]) { /* first block: m = -inf, the sums are 0 anyway */
                    const float c = expf(mj[g] - m_new);
                    lj[g] *= c;
                    for (int i = 0; i < head_dim; ++i) accj[g * head_dim + i] *= c;
                    mj[g] = m_new;
                }
                for (int t = 0; t < tokens; ++t) shift[t * group + g] = m_new;
            }
            /* The block's weights e^(score - max), 8 at a time, then each head's sum. */
            const int scored = tokens * group;
            int i = 0;
            if (vec)
                for (; i + 8 <= scored; i += 8)
                    STORE(w + i, exp_v8(LOAD(w + i) - LOAD(shift + i)));
            for (; i < scored; ++i) w[i] = expf(w[i] - shift[i]);
            for (int t = 0; t < tokens; ++t)
                for (int g = 0; g < group; ++g) lj[g] += w[t * group + g];
            /* Values: each V row is read once for all `group` heads. */
            for (int t = 0; t < tokens; ++t)
                rows[t] = row_f32(v_cache, base + t * stride_token, kind, head_dim,
                                  buf + (kind == KIND_F32 ? 0 : t * head_dim));
            for (int g = 0; g < group; g += 4) {
                const int n = group - g < 4 ? group - g : 4;
                if (vec) values_vec(accj + g * head_dim, w + g, group, rows, tokens, n,
                                      head_dim);
                else values_any(accj + g * head_dim, w + g, group, rows, tokens, n, head_dim);
            }
        }
    }
    __asm__ volatile("" : : "r"(touched)); /* the loads of touch_block stay */
    for (int h = 0; h < heads; ++h)
        for (int i = 0; i < head_dim; ++i) acc[h * head_dim + i] /= l[h];
}

/* attend_item_group with the group size a constant for the usual ones (MHA's 1, and the
 * 2, 3, 4 and 8 query heads per KV head of common GQA models), so that the loops over a KV
 * head's query heads (scores, softmax, weights) unroll. Measured with SmolLM2's shapes
 * (group 3) on a 2-core AMD EPYC (2026-12-07), two threads: alone on 30 layers' caches, 32
 * sequences went from 220-230 to 211-222 us a layer, 8 from 43-45 to 39; a whole decode step
 * of 32 sequences (the two kernels in turn in one process) from 29.87 to 29.38 ms with the
 * blocks shuffled, 26.03 to 25.87 in order (medians of 4). The library then takes about 4 s
 * to compile instead of 1, once per machine. */
static void attend_item(int s, int kvh0, int kv_heads, const float *q, const void *k_cache,
                        const void *v_cache, int kind, const int32_t *block_tables,
                        const int32_t *seq_lens, float *out, int num_heads, int group,
                        int head_dim, int block_size, int64_t table_width,
                        int64_t stride_block, int64_t stride_token, int64_t stride_head,
                        float scale, int after) {
#define ATTEND(g) attend_item_group(s, kvh0, kv_heads, q, k_cache, v_cache, kind, block_tables, \
                                    seq_lens, out, num_heads, g, head_dim, block_size,      \
                                    table_width, stride_block, stride_token, stride_head,   \
                                    scale, after)
    switch (group) {
    case 1: ATTEND(1); break;
    case 2: ATTEND(2); break;
    case 3: ATTEND(3); break;
    case 4: ATTEND(4); break;
    case 8: ATTEND(8); break;
    default: ATTEND(group); break;
    }
#undef ATTEND
}

/* Work items (sequence, `kv_heads_per_item` KV heads) are taken from *next_item until
 * none is left. */
void paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind,
                  const int32_t *block_tables, const int32_t *seq_lens, float *out,
                  int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                  int block_size, int64_t table_width, int64_t stride_block,
                  int64_t stride_token, int64_t stride_head, float scale,
                  int kv_heads_per_item, int64_t *next_item) {
    const int group = num_heads / num_kv_heads;
    const int per_seq = (num_kv_heads + kv_heads_per_item - 1) / kv_heads_per_item;
    const int64_t items = (int64_t)num_seqs * per_seq;
    for (;;) {
        const int64_t it = __atomic_fetch_add(next_item, 1, __ATOMIC_RELAXED);
        if (it >= items) return;
        const int kvh0 = (int)(it % per_seq) * kv_heads_per_item;
        const int n = num_kv_heads - kvh0 < kv_heads_per_item ? num_kv_heads - kvh0
                                                              : kv_heads_per_item;
#ifdef _OPENMP /* the counter hands items out in turn: this thread's next is about `it + team` */
        const int64_t guess = it + omp_get_num_threads();
#else
        const int64_t guess = it + 1;
#endif
        const int after = per_seq == 1 && guess < items ? (int)guess : -1;
        attend_item((int)(it / per_seq), kvh0, n, q, k_cache, v_cache, kind, block_tables,
                    seq_lens, out, num_heads, group, head_dim, block_size, table_width,
                    stride_block, stride_token, stride_head, scale, after);
    }
}

#ifdef _OPENMP
/* paged_decode() run by `num_threads` threads of the calling thread's OpenMP team. */
void paged_decode_team(const float *q, const void *k_cache, const void *v_cache, int kind,
                       const int32_t *block_tables, const int32_t *seq_lens, float *out,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                       int block_size, int64_t table_width, int64_t stride_block,
                       int64_t stride_token, int64_t stride_head, float scale,
                       int kv_heads_per_item, int64_t *next_item, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_decode(q, k_cache, v_cache, kind, block_tables, seq_lens, out, num_seqs,
                 num_heads, num_kv_heads, head_dim, block_size, table_width, stride_block,
                 stride_token, stride_head, scale, kv_heads_per_item, next_item);
}
#endif
