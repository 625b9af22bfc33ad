/*
 * y = x @ W.T for float32 rows on a CPU, with W packed once into column panels (loaded by
 * paged_lib/kernels/cpu_linear.py, built into one library with paged_decode.c).
 *
 * A decode step multiplies a few rows (one per sequence) by every weight of the model:
 * the work is reading the weights, and the product is as fast as they stream in. So the
 * weight [n, k] is stored as panels of PANEL = 32 output columns, each panel k rows of 32
 * floats one after the other ([panel][k][32], the last panel padded with zeros): a thread
 * reads each panel front to back as one stream, and asks for the bytes PREFETCH rows
 * ahead while it computes the current ones. A tile of up to TILE_ROWS = 8 input rows by
 * one panel keeps its 8 x 32 sums in 16 vector registers (two 16-float vectors a row), so
 * each weight vector, once loaded, is used by 8 rows; more rows take the same panel again,
 * a chunk at a time, from the core's cache (linear_rows). Panels are shared out between the threads of the calling
 * thread's OpenMP team (PyTorch's own, see paged_decode.c).
 *
 * Each output is one sum over k in order, in float32, so results differ from PyTorch's
 * (whose kernels split and reorder the sum) by rounding only.
 */
#include <stdint.h>
#include <string.h>

#include "team.h"

#define PANEL 32
#define TILE_ROWS 8
/* Rows of a panel ahead to prefetch (past a panel's end, the next panel's; past the last,
 * an address never read, which a prefetch may name): 64 rows is 8 KB, a few hundred
 * nanoseconds of streaming. On a 2-core AMD EPYC (2026-12-07) it took 8 rows through
 * SmolLM2's 424 MB of maps from 42 to 60 GB/s; 8 and 16 rows ahead gained little, 128 and
 * 256 lost it again. Neither of these was kept (same machine, same maps): 2 MB pages for
 * the packed weights (madvise) gained 1-4% at one row and under 1% at 32; tiles of 12 rows
 * gained 4% at 24 rows and 1% at 32 and lost 3% at 64. */
#define PREFETCH 64

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* W [n, k] (rows contiguous) into panels [ceil(n / 32)][k][32], zero-padded. */
void linear_pack(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t j = 0; j < PANEL; ++j) {
            const int64_t col = p * PANEL + j;
            float *dst = packed + p * k * PANEL + j;
            if (col < n)
                for (int64_t i = 0; i < k; ++i) dst[i * PANEL] = w[col * k + i];
            else
                for (int64_t i = 0; i < k; ++i) dst[i * PANEL] = 0.0f;
        }
}

/* `rows` (1..8, a constant in each case so the row loop unrolls) rows of x by `kn` rows of
 * one panel, adding to their sums in `sums` (rows of 32; zeros first when `first`). */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t ldx, const float *w, int64_t kn, int rows, float *sums,
        int first) {
    v16 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; ++r) {
        acc[r][0] = first ? (v16){} : *(const v16 *)(sums + r * PANEL);
        acc[r][1] = first ? (v16){} : *(const v16 *)(sums + r * PANEL + 16);
    }
    for (int64_t i = 0; i < kn; ++i, w += PANEL) {
        __builtin_prefetch(w + PREFETCH * PANEL);
        __builtin_prefetch(w + PREFETCH * PANEL + 16);
        const v16 w0 = *(const v16 *)w, w1 = *(const v16 *)(w + 16);
#pragma GCC unroll 8
        for (int r = 0; r < rows; ++r) {
            const float xr = x[r * ldx + i];
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
        }
    }
    for (int r = 0; r < rows; ++r) {
        *(v16 *)(sums + r * PANEL) = acc[r][0];
        *(v16 *)(sums + r * PANEL + 16) = acc[r][1];
    }
}

static void tile_any(const float *x, int64_t ldx, const float *w, int64_t kn, int rows,
                     float *sums, int first) {
    switch (rows) {
    case 1: tile(x, ldx, w, kn, 1, sums, first); break;
    case 2: tile(x, ldx, w, kn, 2, sums, first); break;
    case 3: tile(x, ldx, w, kn, 3, sums, first); break;
    case 4: tile(x, ldx, w, kn, 4, sums, first); break;
    case 5: tile(x, ldx, w, kn, 5, sums, first); break;
    case 6: tile(x, ldx, w, kn, 6, sums, first); break;
    case 7: tile(x, ldx, w, kn, 7, sums, first); break;
    default: tile(x, ldx, w, kn, 8, sums, first); break;
    }
}

/* y [m, n] (rows contiguous) = x [m, k] (row stride ldx) @ W.T, W packed by linear_pack,
 * on `num_threads` threads of the calling thread's OpenMP team (one without -fopenmp);
 * linear_team() is the same work inside a team the caller already runs (decode_layer.c).
 * Rows go in blocks of about ROW_BLOCK_BYTES of x (at most MAX_BLOCK), which stay in a
 * core's cache while every panel passes by: without them, each panel read all of a long
 * prefill's rows from the shared cache again (1536 rows ran at 200 GFLOP/s against 480
 * with them). A panel is taken K_CHUNK of its rows at a time by every tile of the block,
 * so a block of more than 8 rows reads the chunk from memory once and from the core's
 * first cache after, while the next chunk streams in: 32 rows at 15.6-15.9 ms per pass over
 * SmolLM2's maps against 18.0-18.2 with each tile walking the whole panel (32 and 128
 * rows a chunk did worse than 64). */
#define K_CHUNK 64
#define ROW_BLOCK_BYTES (256 * 1024)
#define MAX_BLOCK 128
/* The product's work, shared out between the threads of the enclosing OpenMP team (each
 * takes some panels; outside a team, the calling thread takes them all), with no barrier
 * at the end: the caller waits where it reads y. */
void linear_team(const float *x, int64_t ldx, const float *packed, float *y, int64_t m,
                 int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int64_t block = k ? ROW_BLOCK_BYTES / ((int64_t)sizeof(float) * k) / TILE_ROWS * TILE_ROWS
                      : MAX_BLOCK;
    if (block < TILE_ROWS) block = TILE_ROWS;
    if (block > MAX_BLOCK) block = MAX_BLOCK;
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t r1 = r0 + block < m ? r0 + block : m;
        float sums[MAX_BLOCK * PANEL] __attribute__((aligned(64)));
        if (k == 0)  /* empty sums */
            memset(sums, 0, sizeof sums);
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; ++p) {
            const int cols = (int)(n - p * PANEL < PANEL ? n - p * PANEL : PANEL);
            const float *panel = packed + p * k * PANEL;
            for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
                const int64_t kn = k - k0 < K_CHUNK ? k - k0 : K_CHUNK;
                for (int64_t r = r0; r < r1; r += TILE_ROWS)
                    tile_any(x + r * ldx + k0, ldx, panel + k0 * PANEL, kn,
                             (int)(r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS),
                             sums + (r - r0) * PANEL, k0 == 0);
            }
            for (int64_t r = r0; r < r1; ++r)
                memcpy(y + r * n + p * PANEL, sums + (r - r0) * PANEL,
                       (size_t)cols * sizeof(float));
        }
    }
}

void linear_rows(const float *x, int64_t ldx, const float *packed, float *y, int64_t m,
                 int64_t n, int64_t k, int num_threads) {
    (void)num_threads;
#pragma omp parallel num_threads(num_threads)
    linear_team(x, ldx, packed, y, m, n, k);
}
