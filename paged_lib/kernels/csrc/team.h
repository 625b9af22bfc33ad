/*
 * The steps decode_layer.c runs inside one OpenMP team, each defined in its own file: a
 * step's work is shared out between the threads of the enclosing team (all of it on the
 * calling thread outside one), and only the ones that end in a worksharing loop wait for
 * the others at their end (rope_write_team, add_rms_norm_team, silu_mul_team).
 */
#ifndef PAGED_LIB_TEAM_H
#define PAGED_LIB_TEAM_H
#include <stdint.h>

/* linear.c: y [m, n] = x [m, k] (row stride ldx) @ W.T, W packed by linear_pack; no wait */
void linear_team(const float *x, int64_t ldx, const float *packed, float *y, int64_t m,
                 int64_t n, int64_t k);

/* layer_ops.c */
void add_rms_norm_team(const float *x, const float *h, const float *w, float *sum,
                       float *out, int rows, int dim, float eps);
void rope_write_team(const float *qkv, const float *cos_, const float *sin_,
                     const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                     int rows, int heads, int kv_heads, int d);
void silu_mul_team(const float *gate_up, float *out, int rows, int inter);

/* paged_decode.c: each thread takes items from *next_item until none is left; no wait */
void paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind,
                  const int32_t *block_tables, const int32_t *seq_lens, float *out,
                  int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                  int block_size, int64_t table_width, int64_t stride_block,
                  int64_t stride_token, int64_t stride_head, float scale,
                  int kv_heads_per_item, int64_t *next_item);

#endif
