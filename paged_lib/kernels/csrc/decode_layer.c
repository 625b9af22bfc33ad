/*
 * One decoder layer of a decode step in one call, on one OpenMP team (backend="cpu"; loaded
 * by paged_lib/kernels/cpu_layer.py, built into one library with the files it calls).
 *
 * A decode step runs each layer's nine steps (four linear maps, RoPE with the cache write,
 * attention, two residual adds with their norms, SwiGLU's activation) on one row per
 * sequence. Called from Python one by one, each step is a call of its own: arguments
 * converted, an output allocated, a team of threads woken, and the interpreter's own work in
 * between, run with caches the last map's weights have just flushed. On SmolLM2 that was
 * about 3 ms of a 15 ms step at batch 8 (2026-12-07). Here the same steps run back to back
 * inside one parallel region, a barrier between each and the next, on the same code
 * (linear.c, layer_ops.c, paged_decode.c): the results are the same bits as the calls one
 * by one.
 *
 * x [rows, hidden] is the residual stream and normed its norm for this layer (both
 * updated in place: x + attention + MLP, and that sum's next_norm); scratch holds the
 * intermediates (decode_layer_scratch floats). Weights are packed by linear_pack: Q, K and
 * V stacked ([(heads + 2 kv_heads) * d, hidden]), o_proj, gate and up stacked
 * ([2 * inter, hidden]), down_proj. Caches float32 [blocks, block_size, kv_heads, d],
 * contiguous; slots, tables and lens as rope_write_rows and paged_decode read them.
 */
#include <stdint.h>

#include "team.h"

/* Floats of scratch one call needs. */
int64_t decode_layer_scratch(int rows, int hidden, int heads, int kv_heads, int d, int inter) {
    return (int64_t)rows * ((heads + 2 * kv_heads) * d + 2 * heads * d + 2 * hidden
                            + 3 * inter);
}

void decode_layer(float *x, float *normed, float *scratch, int rows, int hidden, int heads,
                  int kv_heads, int d, int inter, const float *w_qkv, const float *w_o,
                  const float *w_gate_up, const float *w_down, const float *norm2, float eps2,
                  const float *next_norm, float eps_next, const float *cos_, const float *sin_,
                  const int64_t *slots, float *k_cache, float *v_cache, const int32_t *tables,
                  const int32_t *lens, int64_t table_width, int block_size, float scale,
                  int kv_heads_per_item, int threads) {
    const int qkv_width = (heads + 2 * kv_heads) * d, q_width = heads * d;
    float *qkv = scratch, *q = qkv + (int64_t)rows * qkv_width,
          *attn = q + (int64_t)rows * q_width, *o = attn + (int64_t)rows * q_width,
          *h = o + (int64_t)rows * hidden, *gate_up = h + (int64_t)rows * hidden,
          *act = gate_up + (int64_t)rows * 2 * inter, *down = o; /* o is read before down */
    const int64_t stride_token = (int64_t)kv_heads * d, stride_block = block_size * stride_token;
    int64_t next_item = 0; /* paged_decode's shared counter */
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        linear_team(normed, hidden, w_qkv, qkv, rows, qkv_width, hidden);
#pragma omp barrier
        rope_write_team(qkv, cos_, sin_, slots, q, k_cache, v_cache, rows, heads, kv_heads, d);
        paged_decode(q, k_cache, v_cache, 0, tables, lens, attn, rows, heads, kv_heads, d,
                     block_size, table_width, stride_block, stride_token, d, scale,
                     kv_heads_per_item, &next_item);
#pragma omp barrier
        linear_team(attn, q_width, w_o, o, rows, hidden, q_width);
#pragma omp barrier
        add_rms_norm_team(x, o, norm2, x, h, rows, hidden, eps2);
        linear_team(h, hidden, w_gate_up, gate_up, rows, 2 * inter, hidden);
#pragma omp barrier
        silu_mul_team(gate_up, act, rows, inter);
        linear_team(act, inter, w_down, down, rows, hidden, inter);
#pragma omp barrier
        add_rms_norm_team(x, down, next_norm, x, normed, rows, hidden, eps_next);
    }
}
