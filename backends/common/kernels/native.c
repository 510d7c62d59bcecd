/* Fused integer kernels of the CPU runtime (loaded by native.py through ctypes).
 *
 * Every function computes exactly what the int64 reference rules compute (qir.ir.numerics,
 * backends.common.integer_rules): int64 products, an arithmetic right shift after adding
 * 2**(shift-1), saturation. Built with -fwrapv so int64 overflow wraps as torch's int64 does.
 * Each works on a range of rows [r0, r1) so the caller can split one call across threads.
 * Channels are the innermost (contiguous) axis everywhere: NHWC activations, (rows, C) accumulators.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CLAMP(v, lo, hi) ((v) < (lo) ? (lo) : ((v) > (hi) ? (hi) : (v)))

/* out[r, c] = clamp(((acc[r, c] + bias[c]) * mult[c] + 2**(shift[c]-1)) >> shift[c], lo[c], hi[c]),
 * evaluated as clamp(floor(acc * scale[c] + offset[c])) in double with scale = mult * 2**-shift and
 * offset = (bias * mult + 2**(shift-1)) * 2**-shift. Exact (and so equal to the int64 rule) when
 * |acc * mult| + |bias * mult + 2**(shift-1)| < 2**53, which the caller checks: the product and the
 * sum are integers below 2**53 scaled by a power of two, and floor of v * 2**-shift is the shift. */
#define REQUANT_ROWS(NAME, OUT_T)                                                                          \
    void NAME(const int32_t *restrict acc, int64_t lda, int64_t n, const double *restrict scale,         \
              const double *restrict offset, const double *restrict lo, const double *restrict hi,        \
              OUT_T *restrict out, int64_t r0, int64_t r1) {                                              \
        for (int64_t r = r0; r < r1; ++r) {                                                                \
            const int32_t *restrict a = acc + r * lda;                                                     \
            OUT_T *restrict o = out + r * n;                                                               \
            for (int64_t c = 0; c < n; ++c) {                                                              \
                double v = floor((double)a[c] * scale[c] + offset[c]);                                     \
                v = v < lo[c] ? lo[c] : v;                                                                 \
                v = v > hi[c] ? hi[c] : v;                                                                 \
                o[c] = (OUT_T)(int32_t)v;                                                                  \
            }                                                                                              \
        }                                                                                                  \
    }

REQUANT_ROWS(qir_requant_rows_i8, int8_t)
REQUANT_ROWS(qir_requant_rows_i16, int16_t)

/* The fused conv + add rule: both operands requantized onto the intermediate grid (each
 * saturated to int32), summed in int64, shifted right by p with half-up rounding, clamped. */
#define FUSED_ADD_ROWS(NAME, ADD_T, OUT_T)                                                             \
    void NAME(const int32_t *restrict acc, int64_t lda, int64_t n, const ADD_T *restrict addend,      \
              const int64_t *restrict bias,                                                            \
              const int64_t *mult, const int64_t *half, const int64_t *shift, int64_t add_mult,       \
              int64_t add_half, int64_t add_shift, int64_t p, const int64_t *lo, const int64_t *hi,     \
              OUT_T *restrict out, int64_t r0, int64_t r1) {                                           \
        const int64_t hp = p > 0 ? ((int64_t)1 << (p - 1)) : 0;                                        \
        for (int64_t r = r0; r < r1; ++r) {                                                            \
            const int32_t *a = acc + r * lda;                                                          \
            const ADD_T *d = addend + r * n;                                                           \
            OUT_T *o = out + r * n;                                                                    \
            for (int64_t c = 0; c < n; ++c) {                                                          \
                int64_t x = (((int64_t)a[c] + bias[c]) * mult[c] + half[c]) >> shift[c];               \
                int64_t y = ((int64_t)d[c] * add_mult + add_half) >> add_shift;                        \
                x = CLAMP(x, (int64_t)INT32_MIN, (int64_t)INT32_MAX);                                  \
                y = CLAMP(y, (int64_t)INT32_MIN, (int64_t)INT32_MAX);                                  \
                int64_t v = (x + y + hp) >> p;                                                         \
                o[c] = (OUT_T)CLAMP(v, lo[c], hi[c]);                                                  \
            }                                                                                          \
        }                                                                                              \
    }

FUSED_ADD_ROWS(qir_fused_add_rows_i8_i8, int8_t, int8_t)
FUSED_ADD_ROWS(qir_fused_add_rows_i8_i16, int8_t, int16_t)
FUSED_ADD_ROWS(qir_fused_add_rows_i16_i8, int16_t, int8_t)
FUSED_ADD_ROWS(qir_fused_add_rows_i16_i16, int16_t, int16_t)

/* Depthwise conv (one filter per channel) on int8 NHWC x, weight (KH, KW, C), zero padding,
 * int32 accumulation (exact: |sum| <= KH*KW*128*128 < 2**31 for KH*KW < 2**17), then the double
 * requantization above (the caller checks its bound). Rows are (n, oh) pairs; one output row is OW*C values. */
#define DW_ROWS(NAME, OUT_T)                                                                             \
    int NAME(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, const int8_t *restrict wt, int64_t kh, int64_t kw, \
             int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,          \
             int64_t ow, const double *restrict scale, const double *restrict offset,                     \
             const double *restrict lo, const double *restrict hi, OUT_T *restrict out, int64_t r0,       \
             int64_t r1) {                                                                               \
        int32_t *acc = (int32_t *)malloc(sizeof(int32_t) * (size_t)c);                                   \
        if (!acc) return 1;                                                                              \
        for (int64_t r = r0; r < r1; ++r) {                                                              \
            const int64_t b = r / oh, y = r % oh;                                                        \
            const int8_t *xb = x + b * h * w * c;                                                        \
            for (int64_t xo = 0; xo < ow; ++xo) {                                                        \
                for (int64_t k = 0; k < c; ++k) acc[k] = 0;                                              \
                for (int64_t i = 0; i < kh; ++i) {                                                       \
                    const int64_t yi = y * sh - ph + i * dh;                                             \
                    if (yi < 0 || yi >= h) continue;                                                     \
                    for (int64_t j = 0; j < kw; ++j) {                                                   \
                        const int64_t xi = xo * sw - pw + j * dw;                                        \
                        if (xi < 0 || xi >= w) continue;                                                 \
                        const int8_t *px = xb + (yi * w + xi) * c;                                       \
                        const int8_t *pk = wt + (i * kw + j) * c;                                        \
                        for (int64_t k = 0; k < c; ++k) acc[k] += (int32_t)px[k] * (int32_t)pk[k];       \
                    }                                                                                    \
                }                                                                                        \
                OUT_T *o = out + (r * ow + xo) * c;                                                      \
                for (int64_t k = 0; k < c; ++k) {                                                        \
                    double v = floor((double)acc[k] * scale[k] + offset[k]);                             \
                    v = v < lo[k] ? lo[k] : v;                                                           \
                    v = v > hi[k] ? hi[k] : v;                                                           \
                    o[k] = (OUT_T)(int32_t)v;                                                            \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        free(acc);                                                                                       \
        return 0;                                                                                        \
    }

DW_ROWS(qir_dw_rows_i8, int8_t)
DW_ROWS(qir_dw_rows_i16, int16_t)

/* im2col for the int8 matrix-product conv: NHWC x -> cols[(n, oy, ox), (i, j, c)], zero where the
 * window reaches into the padding; row stride ldc (>= KH*KW*C; the columns past that are left as
 * they are). Rows of this call are (n, oy) pairs. */
void qir_im2col_i8(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                   int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,
                   int64_t ow, int8_t *restrict cols, int64_t ldc, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / oh, y = r % oh;
        const int8_t *xb = x + b * h * w * c;
        for (int64_t xo = 0; xo < ow; ++xo) {
            int8_t *dst = cols + (r * ow + xo) * ldc;
            for (int64_t i = 0; i < kh; ++i) {
                const int64_t yi = y * sh - ph + i * dh;
                for (int64_t j = 0; j < kw; ++j, dst += c) {
                    const int64_t xi = xo * sw - pw + j * dw;
                    if (yi < 0 || yi >= h || xi < 0 || xi >= w)
                        memset(dst, 0, (size_t)c);
                    else
                        memcpy(dst, xb + (yi * w + xi) * c, (size_t)c);
                }
            }
        }
    }
}
