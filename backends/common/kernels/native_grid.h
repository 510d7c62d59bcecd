/* Kernels of QAT training on the integer grid (native_grid.c; qir.quantization.integer_grid_conv). */
#ifndef QIR_NATIVE_GRID_H
#define QIR_NATIVE_GRID_H
#include <stdint.h>

/* Rows [r0, r1) of a contiguous float32 accumulator of rows of hw elements, row r in channel r % c:
 * v = (float)floor((double)acc * ratio[ch] + offset[ch]) (two float64 roundings, no fused multiply-add),
 * gain = acc_grad[ch] where lo - 1/2 < v < hi + 1/2 else 0, out = clamp(v, lo, hi) * out_scale (float32).
 * out may be acc itself (each element is read before it is written). */
void qir_grid_requant_rows(const float *acc, int64_t hw, int64_t c, const double *ratio, const double *offset,
                           const float *acc_grad, int64_t lo, int64_t hi, float out_scale, float *out, float *gain,
                           int64_t r0, int64_t r1);

/* Rows [r0, r1) of a contiguous float32 tensor cut in rows of len elements (the last row up to n):
 * out = round-half-even(x * inv) in float32 (torch.mul by a float32 scalar, then round_). */
void qir_grid_codes_rows(const float *x, int64_t n, int64_t len, float inv, float *out, int64_t r0, int64_t r1);

/* Rows [r0, r1) of a contiguous float32 weight of rows of k elements (its output channels), row r at
 * scale[r % c]: v = w / scale (float32), q = floor(v) + (v - floor(v) >= 1/2), out = clamp(q, qmin, qmax),
 * factor = fac[r % c] where out == q (not clamped, not NaN) else 0. */
void qir_grid_weight_codes_rows(const float *w, int64_t k, int64_t c, const float *scale, const float *fac,
                                int64_t qmin, int64_t qmax, float *out, float *factor, int64_t r0, int64_t r1);

/* Rows [r0, r1_) of the fused conv + add on contiguous float32 tensors of rows of hw elements, row r in channel
 * r % c (integer_grid_conv.fused_add_blocks, the same float64 operations, no fused multiply-add):
 * a = clamp(acc, acc_lo[ch], acc_hi[ch]) (float32), mid1 = floor((double)a * r1[ch] + off1[ch]),
 * mid2 = floor((double)round-half-even(addend * inv_add) * *r2 + 1/2),
 * v = (float)floor((mid1 + mid2) * 2**-extra_bits + 1/2), keep = 1 where lo - 1/2 < v < hi + 1/2 else 0,
 * out = clamp(v, lo, hi) * out_scale. out may be acc itself (each element is read before it is written). */
void qir_grid_fused_add_rows(const float *acc, const float *addend, int64_t hw, int64_t c, const float *acc_lo,
                             const float *acc_hi, const double *r1, const double *off1, const double *r2, float inv_add,
                             int64_t extra_bits, int64_t lo, int64_t hi, float out_scale, float *out, float *keep,
                             int64_t r0, int64_t r1_);

/* Rows [r0, r1) of contiguous float32 weight codes (integers of magnitude below 2**24) of rows of k elements:
 * the largest row sum of |q| (exact, in int64), or INT64_MAX when a code is NaN (qir_run keeps negative
 * results for its refusals). */
int64_t qir_grid_abs_row_max(const float *q, int64_t k, int64_t r0, int64_t r1);

#endif
