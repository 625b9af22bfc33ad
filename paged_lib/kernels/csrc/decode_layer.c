/*
 * A decode step's decoder layers in one call, on one OpenMP team (backend="cpu"; loaded
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
 * At 32 sequences the step is bound by memory and arithmetic together, not by either: the
 * maps are nearly as fast as the core's multiply-adds allow, and attention then reads its
 * K/V from memory on its own. Asking for the next layer's K/V during this layer's MLP (a
 * few cache lines before each tile of the gate/up and down maps) was measured on a 2-core
 * AMD EPYC (2026-12-07): attention went from 7.5 to 4.6-4.8 ms a step and the maps from
 * 15.7 to 19.5-20.7; fewer lines asked for moved both by about as much. So it is not done.
 *
 * decode_layers() runs a step's layers so, one after another in the same region: x
 * [rows, hidden] is the residual stream and normed its norm for the first layer (both
 * updated in place, layer by layer: x + attention + MLP, and that sum's next norm);
 * scratch holds a layer's intermediates (decode_layer_scratch floats). Weights are packed
 * by linear_pack: Q, K and V stacked ([(heads + 2 kv_heads) * d, hidden]), o_proj, gate
 * and up stacked ([2 * inter, hidden]), down_proj. Caches float32 [blocks, block_size,
 * kv_heads, d], contiguous; slots, tables and lens as rope_write_rows and paged_decode read
 * them, the same for every layer.
 */
#include <stdint.h>

#include "team.h"

/* Floats of scratch one call needs. */
int64_t decode_layer_scratch(int rows, int hidden, int heads, int kv_heads, int d, int inter) {
    return (int64_t)rows * ((heads + 2 * kv_heads) * d + 2 * heads * d + 2 * hidden
                            + 3 * inter);
}

/* One layer's own arrays: its packed maps, its two norms (the second is the next layer's
 * input norm, or the model's final one) and its caches. */
struct decode_layer_args {
    const float *w_qkv, *w_o, *w_gate_up, *w_down, *norm2, *next_norm;
    float *k_cache, *v_cache;
    float eps2, eps_next;
};

/* One layer, run by every thread of the enclosing team; ends once all have finished it
 * (the last step's worksharing loop waits). */
static void layer_in_team(const struct decode_layer_args *L, float *x, float *normed,
                          float *scratch, int rows, int hidden, int heads, int kv_heads,
                          int d, int inter, const float *cos_, const float *sin_,
                          const int64_t *slots, const int32_t *tables, const int32_t *lens,
                          int64_t table_width, int block_size, float scale,
                          int kv_heads_per_item, int64_t *next_item) {
    const int qkv_width = (heads + 2 * kv_heads) * d, q_width = heads * d;
    float *qkv = scratch, *q = qkv + (int64_t)rows * qkv_width,
          *attn = q + (int64_t)rows * q_width, *o = attn + (int64_t)rows * q_width,
          *h = o + (int64_t)rows * hidden, *gate_up = h + (int64_t)rows * hidden,
          *act = gate_up + (int64_t)rows * 2 * inter, *down = o; /* o is read before down */
    const int64_t stride_token = (int64_t)kv_heads * d, stride_block = block_size * stride_token;
    linear_team(normed, hidden, L->w_qkv, qkv, rows, qkv_width, hidden);
#pragma omp barrier
    rope_write_team(qkv, cos_, sin_, slots, q, L->k_cache, L->v_cache, rows, heads, kv_heads,
                    d);
    paged_decode(q, L->k_cache, L->v_cache, 0, tables, lens, attn, rows, heads, kv_heads, d,
                 block_size, table_width, stride_block, stride_token, d, scale,
                 kv_heads_per_item, next_item);
#pragma omp barrier
    linear_team(attn, q_width, L->w_o, o, rows, hidden, q_width);
#pragma omp barrier
    add_rms_norm_team(x, o, L->norm2, x, h, rows, hidden, L->eps2);
    linear_team(h, hidden, L->w_gate_up, gate_up, rows, 2 * inter, hidden);
#pragma omp barrier
    silu_mul_team(gate_up, act, rows, inter);
    linear_team(act, inter, L->w_down, down, rows, hidden, inter);
#pragma omp barrier
    add_rms_norm_team(x, down, L->next_norm, x, normed, rows, hidden, L->eps_next);
}

/* The layers one after another, all in one parallel region. */
void decode_layers(int num_layers, const struct decode_layer_args *layers, float *x,
                   float *normed, float *scratch, int rows, int hidden, int heads, int kv_heads,
                   int d, int inter, const float *cos_, const float *sin_, const int64_t *slots,
                   const int32_t *tables, const int32_t *lens, int64_t table_width,
                   int block_size, float scale, int kv_heads_per_item, int threads) {
    int64_t next_item[num_layers > 0 ? num_layers : 1]; /* paged_decode's counter, a layer each */
    for (int l = 0; l < num_layers; ++l) next_item[l] = 0;
    (void)threads;
#pragma omp parallel num_threads(threads)
    for (int l = 0; l < num_layers; ++l)
        layer_in_team(layers + l, x, normed, scratch, rows, hidden, heads, kv_heads, d, inter,
                      cos_, sin_, slots, tables, lens, table_width, block_size, scale,
                      kv_heads_per_item, next_item + l);
}
