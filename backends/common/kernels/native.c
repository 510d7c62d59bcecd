/* Fused integer kernels of the CPU runtime (loaded by native.py through ctypes).
 *
 * Every function computes exactly what the int64 reference rules compute (qir.ir.numerics,
 * backends.common.integer_rules): int64 products, an arithmetic right shift after adding
 * 2**(shift-1), saturation. Built with -fwrapv so int64 overflow wraps as torch's int64 does.
 * Each works on a range of rows [r0, r1) and writes only those rows' outputs, so qir_run (at the
 * end) splits one call across the thread pool of native_pool.c with results independent of the split.
 * Channels are the innermost (contiguous) axis everywhere: NHWC activations, (rows, C) accumulators.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_dw.h"
#include "native_grid.h"
#include "native_weights.h"
#include "native_pool.h"
#include "native_requant.h"
#include "native_simd.h"

/* What this build holds: bit 0 = the AVX-512 VNNI matrix product (qir_gemm_vnni). */
int qir_caps(void) { return QIR_VNNI; }

#define CLAMP(v, lo, hi) ((v) < (lo) ? (lo) : ((v) > (hi) ? (hi) : (v)))

/* out[r, c] = clamp(((acc[r, c] + bias[c]) * mult[c] + 2**(shift[c]-1)) >> shift[c], lo[c], hi[c]) in integer
 * arithmetic, rq: the parameters packed per block of 16 channels (native_requant.h, conv.py's pack_requant),
 * fast: their mode. Channel blocks outside, rows inside: a block's parameters stay in registers. */
#define REQUANT_ROWS(NAME, OUT_T)                                                                           \
    void NAME(const int32_t *restrict acc, int64_t lda, int64_t n, const qir_rqblock *restrict rq,         \
              int64_t fast, OUT_T *restrict out, int64_t r0, int64_t r1) {                                  \
        for (int64_t c = 0; c < n; c += 16) {                                                               \
            const qir_rqblock *b = rq + c / 16;                                                             \
            QIR_REQUANT_BLOCK(OUT_T)                                                                        \
        }                                                                                                   \
    }
#if QIR_VNNI
#define QIR_REQUANT_BLOCK(OUT_T)                                                                            \
    const __mmask16 m = lanes16(n - c);                                                                     \
    const qir_rqv q = rqv_load(b);                                                                          \
    if (fast)                                                                                               \
        for (int64_t r = r0; r < r1; ++r)                                                                   \
            QIR_STORE16(OUT_T, out + r * n + c, m,                                                          \
                        rqv_apply(_mm512_maskz_loadu_epi32(m, acc + r * lda + c), &q, 1));                  \
    else                                                                                                    \
        for (int64_t r = r0; r < r1; ++r)                                                                   \
            QIR_STORE16(OUT_T, out + r * n + c, m,                                                          \
                        rqv_apply(_mm512_maskz_loadu_epi32(m, acc + r * lda + c), &q, 0));
#elif QIR_AVX2
#define QIR_REQUANT_BLOCK(OUT_T)                                                                            \
    for (int h = 0; h < 2 && c + 8 * h < n; ++h) {                                                          \
        const int64_t c8 = c + 8 * h;                                                                       \
        if (fast && c8 + 8 <= n) {                                                                          \
            const qir_rq8 q = rq8_load(b, h);                                                               \
            for (int64_t r = r0; r < r1; ++r)                                                               \
                QIR_STORE8(OUT_T, out + r * n + c8,                                                         \
                           rq8_apply(_mm256_loadu_si256((const __m256i *)(acc + r * lda + c8)), &q));       \
        } else {                                                                                            \
            const int kn = (int)(n - c8 < 8 ? n - c8 : 8);                                                  \
            for (int64_t r = r0; r < r1; ++r)                                                               \
                for (int k = 0; k < kn; ++k)                                                                \
                    out[r * n + c8 + k] = (OUT_T)rq_scalar(b, 8 * h + k, acc[r * lda + c8 + k], fast);      \
        }                                                                                                   \
    }
#else
#define QIR_REQUANT_BLOCK(OUT_T)                                                                            \
    const int kn = (int)(n - c < 16 ? n - c : 16);                                                          \
    for (int64_t r = r0; r < r1; ++r)                                                                       \
        for (int k = 0; k < kn; ++k) out[r * n + c + k] = (OUT_T)rq_scalar(b, k, acc[r * lda + c + k], fast);
#endif

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
 * int32 accumulation (exact: |sum| <= KH*KW*128*128 < 2**31 for KH*KW < 2**17), then the integer
 * requantization (native_requant.h). Rows are (n, oh) pairs; one output row is OW*C values. */
#define DW_ROWS(NAME, OUT_T)                                                                             \
    static int NAME(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, const int8_t *restrict wt, int64_t kh, int64_t kw, \
             int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,          \
             int64_t ow, const qir_rqblock *restrict rq, int64_t fast, OUT_T *restrict out, int64_t r0,   \
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
                for (int64_t k = 0; k < c; ++k) o[k] = (OUT_T)rq_scalar(rq + k / 16, (int)(k % 16), acc[k], fast); \
            }                                                                                            \
        }                                                                                                \
        free(acc);                                                                                       \
        return 0;                                                                                        \
    }

DW_ROWS(dw_rows_generic_i8, int8_t)
DW_ROWS(dw_rows_generic_i16, int16_t)

#if QIR_VNNI
/* The same depthwise conv with AVX-512: per output pixel, 64 channels at a time in four int32
 * registers; each tap adds x * w with one vpdpwssd (int16 pairs: x sign-extended to 32 bits times
 * w in the low half of a lane whose high half is zero, so the pair's second product is 0).
 * Channels past c are masked off when loading x and zero in the widened weights. */
#define QIR_DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b))
#define DW_ROWS_AVX512(NAME, OUT_T)                                                                      \
    static int NAME(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, const int8_t *restrict wt,  \
                    int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,     \
                    int64_t dw, int64_t oh, int64_t ow, const qir_rqblock *restrict rq, int64_t fast,      \
                    OUT_T *restrict out, int64_t r0, int64_t r1) {                                         \
        const int64_t cp = (c + 63) / 64 * 64;                                                             \
        int32_t *w32 = (int32_t *)calloc((size_t)(kh * kw * cp), sizeof(int32_t));                        \
        if (!w32) return 1;                                                                                \
        for (int64_t t = 0; t < kh * kw; ++t)                                                              \
            for (int64_t k = 0; k < c; ++k) w32[t * cp + k] = (int32_t)(uint16_t)(int16_t)wt[t * c + k];  \
        for (int64_t r = r0; r < r1; ++r) {                                                                \
            const int64_t b = r / oh, y = r % oh;                                                          \
            const int8_t *xb = x + b * h * w * c;                                                          \
            int64_t i0 = 0, i1 = kh; /* the taps inside the input: [i0, i1) x [j0, j1) */                 \
            while (i0 < kh && y * sh - ph + i0 * dh < 0) ++i0;                                             \
            while (i1 > i0 && y * sh - ph + (i1 - 1) * dh >= h) --i1;                                      \
            for (int64_t xo = 0; xo < ow; ++xo) {                                                          \
                OUT_T *o = out + (r * ow + xo) * c;                                                        \
                int64_t j0 = 0, j1 = kw;                                                                   \
                while (j0 < kw && xo * sw - pw + j0 * dw < 0) ++j0;                                        \
                while (j1 > j0 && xo * sw - pw + (j1 - 1) * dw >= w) --j1;                                 \
                for (int64_t cb = 0; cb < c; cb += 64) {                                                   \
                    const int64_t cn = c - cb < 64 ? c - cb : 64;                                          \
                    const __mmask16 m0 = cn >= 16 ? 0xFFFF : (__mmask16)((1u << cn) - 1);                  \
                    const __mmask16 m1 = cn >= 32 ? 0xFFFF : cn <= 16 ? 0 : (__mmask16)((1u << (cn - 16)) - 1); \
                    const __mmask16 m2 = cn >= 48 ? 0xFFFF : cn <= 32 ? 0 : (__mmask16)((1u << (cn - 32)) - 1); \
                    const __mmask16 m3 = cn >= 64 ? 0xFFFF : cn <= 48 ? 0 : (__mmask16)((1u << (cn - 48)) - 1); \
                    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;                        \
                    for (int64_t i = i0; i < i1; ++i) {                                                    \
                        const int64_t yi = y * sh - ph + i * dh;                                           \
                        for (int64_t j = j0; j < j1; ++j) {                                                \
                            const int64_t xi = xo * sw - pw + j * dw;                                      \
                            const int8_t *px = xb + (yi * w + xi) * c + cb;                                \
                            const int32_t *pk = w32 + (i * kw + j) * cp + cb;                              \
                            QIR_DPWSSD(a0, _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, px)),             \
                                       _mm512_loadu_si512((const void *)pk));                              \
                            if (cn > 16)                                                                   \
                                QIR_DPWSSD(a1, _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, px + 16)),    \
                                           _mm512_loadu_si512((const void *)(pk + 16)));                   \
                            if (cn > 32)                                                                   \
                                QIR_DPWSSD(a2, _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m2, px + 32)),    \
                                           _mm512_loadu_si512((const void *)(pk + 32)));                   \
                            if (cn > 48)                                                                   \
                                QIR_DPWSSD(a3, _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m3, px + 48)),    \
                                           _mm512_loadu_si512((const void *)(pk + 48)));                   \
                        }                                                                                  \
                    }                                                                                      \
                    {                                                                                      \
                        OUT_T *oc = o + cb;                                                                \
                        const qir_rqblock *b = rq + cb / 16;                                               \
                        qir_rqv q = rqv_load(b);                                                           \
                        QIR_STORE16(OUT_T, oc, m0, rqv_apply(a0, &q, fast));                               \
                        if (cn > 16) { q = rqv_load(b + 1); QIR_STORE16(OUT_T, oc + 16, m1, rqv_apply(a1, &q, fast)); } \
                        if (cn > 32) { q = rqv_load(b + 2); QIR_STORE16(OUT_T, oc + 32, m2, rqv_apply(a2, &q, fast)); } \
                        if (cn > 48) { q = rqv_load(b + 3); QIR_STORE16(OUT_T, oc + 48, m3, rqv_apply(a3, &q, fast)); } \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        free(w32);                                                                                         \
        return 0;                                                                                          \
    }
DW_ROWS_AVX512(dw_rows_avx512_i8, int8_t)
DW_ROWS_AVX512(dw_rows_avx512_i16, int16_t)
#define QIR_DW_IMPL(t) dw_rows_avx512_##t
#elif QIR_AVX2
/* The same depthwise conv with AVX2 (CPUs without AVX-512): 8 channels of one output row per
 * register, the block's requantization parameters loaded once per row, each tap one vpmaddwd on the
 * code sign-extended to 32 bits and the weight in the low half of a lane whose high half is zero
 * (the pair's second product is 0), as the AVX-512 loop's vpdpwssd. The taps inside the input are
 * found once per output pixel; channels past the last multiple of 8 take the scalar loop. */
#define DW_ROWS_AVX2(NAME, OUT_T)                                                                         \
    static int NAME(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, const int8_t *restrict wt,  \
                    int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,     \
                    int64_t dw, int64_t oh, int64_t ow, const qir_rqblock *restrict rq, int64_t fast,      \
                    OUT_T *restrict out, int64_t r0, int64_t r1) {                                         \
        const int64_t c8 = c / 8 * 8, taps = kh * kw;                                                      \
        int32_t *w32 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(taps * (c8 > 0 ? c8 : 1)));           \
        if (!w32) return 1;                                                                                \
        for (int64_t t = 0; t < taps; ++t)                                                                 \
            for (int64_t k = 0; k < c8; ++k) w32[t * c8 + k] = (int32_t)(uint16_t)(int16_t)wt[t * c + k];  \
        for (int64_t r = r0; r < r1; ++r) {                                                                \
            const int64_t b = r / oh, y = r % oh;                                                          \
            const int8_t *xb = x + b * h * w * c;                                                          \
            int64_t i0 = 0, i1 = kh; /* the kernel rows inside the input: [i0, i1) */                     \
            while (i0 < kh && y * sh - ph + i0 * dh < 0) ++i0;                                             \
            while (i1 > i0 && y * sh - ph + (i1 - 1) * dh >= h) --i1;                                      \
            for (int64_t cb = 0; cb < c8; cb += 8) {                                                       \
                const qir_rq8 q = rq8_load(rq + cb / 16, (int)(cb % 16) / 8);                              \
                int32_t lanes[8];                                                                          \
                for (int64_t xo = 0; xo < ow; ++xo) {                                                      \
                    int64_t j0 = 0, j1 = kw;                                                               \
                    while (j0 < kw && xo * sw - pw + j0 * dw < 0) ++j0;                                    \
                    while (j1 > j0 && xo * sw - pw + (j1 - 1) * dw >= w) --j1;                             \
                    __m256i a = _mm256_setzero_si256();                                                    \
                    for (int64_t i = i0; i < i1; ++i) {                                                    \
                        const int8_t *row = xb + (y * sh - ph + i * dh) * w * c + cb;                      \
                        const int32_t *pk = w32 + i * kw * c8 + cb;                                        \
                        for (int64_t j = j0; j < j1; ++j) {                                                \
                            const int8_t *px = row + (xo * sw - pw + j * dw) * c;                          \
                            const __m256i xv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)px)); \
                            a = _mm256_add_epi32(a, _mm256_madd_epi16(xv, _mm256_loadu_si256((const __m256i *)(pk + j * c8)))); \
                        }                                                                                  \
                    }                                                                                      \
                    OUT_T *o = out + (r * ow + xo) * c + cb;                                               \
                    if (fast) {                                                                            \
                        const __m256i v = rq8_apply(a, &q);                                                \
                        QIR_STORE8(OUT_T, o, v);                                                           \
                    } else {                                                                               \
                        _mm256_storeu_si256((__m256i *)lanes, a);                                          \
                        for (int k = 0; k < 8; ++k)                                                        \
                            o[k] = (OUT_T)rq_scalar(rq + cb / 16, (int)(cb % 16) + k, lanes[k], 0);        \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int64_t xo = 0; xo < ow && c8 < c; ++xo) {                                                \
                for (int64_t k = c8; k < c; ++k) {                                                         \
                    int32_t a = 0;                                                                         \
                    for (int64_t i = i0; i < i1; ++i) {                                                    \
                        const int64_t yi = y * sh - ph + i * dh;                                           \
                        for (int64_t j = 0; j < kw; ++j) {                                                 \
                            const int64_t xi = xo * sw - pw + j * dw;                                      \
                            if (xi >= 0 && xi < w) a += (int32_t)xb[(yi * w + xi) * c + k] * wt[(i * kw + j) * c + k]; \
                        }                                                                                  \
                    }                                                                                      \
                    out[(r * ow + xo) * c + k] = (OUT_T)rq_scalar(rq + k / 16, (int)(k % 16), a, fast);    \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        free(w32);                                                                                         \
        return 0;                                                                                          \
    }
DW_ROWS_AVX2(dw_rows_avx2_i8, int8_t)
DW_ROWS_AVX2(dw_rows_avx2_i16, int16_t)
#define QIR_DW_IMPL(t) dw_rows_avx2_##t
#else
#define QIR_DW_IMPL(t) dw_rows_generic_##t
#endif

/* The exported entry points (returns 1 when out of memory). */
#define DW_EXPORT(T, OUT_T)                                                                               \
    int qir_dw_rows_##T(const int8_t *x, int64_t h, int64_t w, int64_t c, const int8_t *wt, int64_t kh,    \
                        int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, \
                        int64_t oh, int64_t ow, const qir_rqblock *rq, int64_t fast, OUT_T *out, int64_t r0, \
                        int64_t r1) {                                                                       \
        if (0) (void)dw_rows_generic_##T; /* kept for builds without AVX-512 or AVX2 */                          \
        return QIR_DW_IMPL(T)(x, h, w, c, wt, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, rq, fast, out, r0, r1); \
    }
DW_EXPORT(i8, int8_t)
DW_EXPORT(i16, int16_t)

/* Copy n int8 codes (n small: one window row of a conv), each xor'ed with flip (0, or 0x80 for the
 * unsigned operand of the VNNI product: a + 128). */
static inline void copy_codes(int8_t *restrict dst, const int8_t *restrict src, int64_t n, uint8_t flip) {
#if QIR_VNNI
    /* masked loads and stores touch only the bytes the mask selects: no read past src + n */
    const __m512i f = _mm512_set1_epi8((char)flip);
    while (n > 0) {
        const int64_t k = n < 64 ? n : 64;
        const __mmask64 m = k == 64 ? ~(__mmask64)0 : (((__mmask64)1 << k) - 1);
        _mm512_mask_storeu_epi8(dst, m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, src), f));
        dst += k, src += k, n -= k;
    }
#else
    for (int64_t t = 0; t < n; ++t) dst[t] = (int8_t)((uint8_t)src[t] ^ flip);
#endif
}

/* The geometry of a conv over NHWC codes (one struct so the per-pixel helpers take one argument). */
typedef struct {
    int64_t h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
} qir_geom;

/* One im2col row: output pixel m = (n, oy, ox) -> dst[(i, j, c)] (KH*KW*C codes xor flip), zero (xor
 * flip) where the window reaches into the padding. Reads only x[n][yi][xi][:] with (yi, xi) inside
 * [0, h) x [0, w). */
static inline void im2col_pixel(const int8_t *restrict x, const qir_geom *g, int64_t b, int64_t y, int64_t xo,
                                int8_t *restrict dst, uint8_t flip) {
    const int64_t c = g->c, w = g->w, kw = g->kw;
    const int8_t *xb = x + b * g->h * w * c;
    const int64_t x0 = xo * g->sw - g->pw;
    for (int64_t i = 0; i < g->kh; ++i, dst += kw * c) {
        const int64_t yi = y * g->sh - g->ph + i * g->dh;
        if (yi < 0 || yi >= g->h) {
            memset(dst, flip, (size_t)(kw * c));
            continue;
        }
        const int8_t *row = xb + yi * w * c;
        if (g->dw == 1) {
            /* the window row [x0, x0 + kw) is contiguous in NHWC: one copy of its inside part */
            const int64_t j0 = x0 < 0 ? (-x0 < kw ? -x0 : kw) : 0;
            const int64_t j1 = w - x0 < kw ? (w - x0 > j0 ? w - x0 : j0) : kw;
            if (j0 > 0) memset(dst, flip, (size_t)(j0 * c));
            if (j1 > j0) copy_codes(dst + j0 * c, row + (x0 + j0) * c, (j1 - j0) * c, flip);
            if (j1 < kw) memset(dst + j1 * c, flip, (size_t)((kw - j1) * c));
            continue;
        }
        for (int64_t j = 0; j < kw; ++j) {
            const int64_t xi = x0 + j * g->dw;
            if (xi < 0 || xi >= w)
                memset(dst + j * c, flip, (size_t)c);
            else
                copy_codes(dst + j * c, row + xi * c, c, flip);
        }
    }
}

/* im2col rows for output pixels [m0, m1), row m at dst + (m - m0) * ld (one division for the first
 * pixel's position, then counters: a division per pixel costs as much as a small window's copy). */
static void im2col_range(const int8_t *restrict x, const qir_geom *g, int64_t m0, int64_t m1, int8_t *restrict dst,
                         int64_t ld, uint8_t flip) {
    int64_t b = m0 / (g->oh * g->ow), y = (m0 / g->ow) % g->oh, xo = m0 % g->ow;
#if QIR_VNNI
    /* A window whose rows are each one run of at most 64 codes (a stem: 7 x 3 = 21) and lie wholly
     * inside the input copies each row with one masked load / store and a mask made once, instead of
     * im2col_pixel's per-row clipping and copy loop: on resnet18's 7x7 stem im2col was a third of the
     * layer. */
    const int64_t run = g->kw * g->c;
    const int fast = g->dw == 1 && run <= 64;
    const __mmask64 mask = run >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << run) - 1);
    const __m512i f = _mm512_set1_epi8((char)flip);
#endif
    for (int64_t m = m0; m < m1; ++m, dst += ld) {
#if QIR_VNNI
        const int64_t y0 = y * g->sh - g->ph, x0 = xo * g->sw - g->pw;
        if (fast && y0 >= 0 && y0 + (g->kh - 1) * g->dh < g->h && x0 >= 0 && x0 + g->kw <= g->w) {
            const int8_t *src = x + ((b * g->h + y0) * g->w + x0) * g->c;
            int8_t *o = dst;
            for (int64_t i = 0; i < g->kh; ++i, o += run, src += g->dh * g->w * g->c)
                _mm512_mask_storeu_epi8(o, mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, src), f));
        } else
#endif
            im2col_pixel(x, g, b, y, xo, dst, flip);
        if (++xo == g->ow) {
            xo = 0;
            if (++y == g->oh) y = 0, ++b;
        }
    }
}

/* im2col for the int8 matrix-product conv: NHWC x -> cols[(n, oy, ox), (i, j, c)]; row stride ldc
 * (>= KH*KW*C; the columns past that are left as they are). Rows of this call are (n, oy) pairs:
 * writes stay inside rows [r0 * ow, r1 * ow) of cols. */
void qir_im2col_i8(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                   int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,
                   int64_t ow, int8_t *restrict cols, int64_t ldc, int64_t r0, int64_t r1) {
    const qir_geom g = {h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow};
    im2col_range(x, &g, r0 * ow, r1 * ow, cols + r0 * ow * ldc, ldc, 0);
}

/* Max pool on NHWC codes: out[n, oy, ox, c] = max over the window's positions inside the input
 * (padding never wins, as in torch). Rows of this call are (n, oy) pairs; the caller checks that
 * every window holds at least one input position (torch's padding <= kernel / 2 rule). */
#define MAXPOOL_ROWS(NAME, T)                                                                            \
    void NAME(const T *restrict x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh, \
              int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow,        \
              T *restrict out, int64_t r0, int64_t r1) {                                                 \
        for (int64_t r = r0; r < r1; ++r) {                                                              \
            const int64_t b = r / oh, y = r % oh;                                                        \
            const T *xb = x + b * h * w * c;                                                             \
            for (int64_t xo = 0; xo < ow; ++xo) {                                                        \
                T *o = out + (r * ow + xo) * c;                                                          \
                int first = 1;                                                                           \
                for (int64_t i = 0; i < kh; ++i) {                                                       \
                    const int64_t yi = y * sh - ph + i * dh;                                             \
                    if (yi < 0 || yi >= h) continue;                                                     \
                    for (int64_t j = 0; j < kw; ++j) {                                                   \
                        const int64_t xi = xo * sw - pw + j * dw;                                        \
                        if (xi < 0 || xi >= w) continue;                                                 \
                        const T *px = xb + (yi * w + xi) * c;                                            \
                        if (first) {                                                                     \
                            for (int64_t k = 0; k < c; ++k) o[k] = px[k];                                \
                            first = 0;                                                                   \
                        } else {                                                                         \
                            for (int64_t k = 0; k < c; ++k) o[k] = px[k] > o[k] ? px[k] : o[k];          \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                if (first)                                                                               \
                    for (int64_t k = 0; k < c; ++k) o[k] = 0; /* unreachable under the caller's check */ \
            }                                                                                            \
        }                                                                                                \
    }

MAXPOOL_ROWS(qir_maxpool_rows_i8, int8_t)
MAXPOOL_ROWS(qir_maxpool_rows_i16, int16_t)

/* Global sum pool: out[b, ch] = the sum over the hw pixels of NHWC codes x[b, p, ch], in int32 (exact:
 * the caller checks hw * 2**15 < 2**31). Rows are batch entries; the loop over channels vectorises. */
#define SUM_PIXELS(NAME, T)                                                                               \
    void NAME(const T *restrict x, int64_t hw, int64_t c, int32_t *restrict out, int64_t r0, int64_t r1) { \
        for (int64_t b = r0; b < r1; ++b) {                                                               \
            int32_t *restrict o = out + b * c;                                                            \
            for (int64_t k = 0; k < c; ++k) o[k] = 0;                                                     \
            for (int64_t p = 0; p < hw; ++p) {                                                            \
                const T *restrict px = x + (b * hw + p) * c;                                              \
                for (int64_t k = 0; k < c; ++k) o[k] += px[k];                                            \
            }                                                                                             \
        }                                                                                                 \
    }

SUM_PIXELS(qir_sum_pixels_i8, int8_t)
SUM_PIXELS(qir_sum_pixels_i16, int16_t)

/* What follows the int32 accumulator of qir_gemm_vnni, per chunk of rows (see native.py's Epilogue). */
typedef struct {
    int64_t kind; /* 1: requantize (qir_requant_rows_*), 2: the fused conv + add (qir_fused_add_rows_*) */
    int64_t out_bits, add_bits; /* 8 or 16 */
    int64_t n;                  /* output channels */
    const qir_rqblock *rq; /* the requantization (kind 1), packed per 16 channels */
    int64_t fast;          /* its mode (native_requant.h) */
    const void *addend;
    const int64_t *bias, *mult, *half, *shift;
    int64_t add_mult, add_half, add_shift, p;
    const int64_t *lo_i, *hi_i;
    void *out;
    /* the fused add's two requantizations onto the intermediate grid, packed (native_requant.h) with the
     * int32 range as their clamp: the accumulator's per channel, the addend's in one block of 16 equal lanes */
    const qir_rqblock *rq_mid, *rq_add;
    int64_t fast_mid, fast_add;
} qir_epilogue;

#if QIR_VNNI
/* qir_fused_add_rows_* on 16 channels at a time: x and y as the plain requantization computes them
 * (clamped to int32), their sum and the final shift by p in 64-bit lanes, saturated to int32 (the
 * final range lies inside it) and clamped to the channel's range (rq's lo, hi). */
#define FUSED_ADD_VEC(NAME, ADD_T, OUT_T)                                                                    \
    static void NAME(const qir_epilogue *e, const int32_t *restrict acc, int64_t lda, const ADD_T *restrict d, \
                     OUT_T *restrict out, int64_t rows) {                                                    \
        const int64_t n = e->n;                                                                              \
        const qir_rqv qy = rqv_load(e->rq_add);                                                              \
        const __m128i pc = _mm_cvtsi64_si128(e->p);                                                          \
        const __m512i hp = _mm512_set1_epi64(e->p > 0 ? (int64_t)1 << (e->p - 1) : 0);                       \
        for (int64_t c = 0; c < n; c += 16) {                                                                \
            const __mmask16 m = lanes16(n - c);                                                              \
            const qir_rqv qx = rqv_load(e->rq_mid + c / 16);                                                 \
            const __m512i lo = _mm512_loadu_si512((const void *)e->rq[c / 16].lo);                           \
            const __m512i hi = _mm512_loadu_si512((const void *)e->rq[c / 16].hi);                           \
            for (int64_t r = 0; r < rows; ++r) {                                                             \
                const __m512i a = _mm512_maskz_loadu_epi32(m, acc + r * lda + c);                            \
                const __m512i dv = sizeof(ADD_T) == 1                                                        \
                                       ? _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, d + r * n + c))        \
                                       : _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, d + r * n + c));  \
                const __m512i x = rqv_apply(a, &qx, e->fast_mid), y = rqv_apply(dv, &qy, e->fast_add);       \
                __m512i s0 = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(x)),              \
                                              _mm512_cvtepi32_epi64(_mm512_castsi512_si256(y)));             \
                __m512i s1 = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(x, 1)),        \
                                              _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(y, 1)));       \
                s0 = _mm512_sra_epi64(_mm512_add_epi64(s0, hp), pc);                                         \
                s1 = _mm512_sra_epi64(_mm512_add_epi64(s1, hp), pc);                                         \
                __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi64_epi32(s0)),            \
                                               _mm512_cvtsepi64_epi32(s1), 1);                               \
                v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);                                           \
                QIR_STORE16(OUT_T, out + r * n + c, m, v);                                                   \
            }                                                                                                \
        }                                                                                                    \
    }
FUSED_ADD_VEC(fused_add_vec_i8_i8, int8_t, int8_t)
FUSED_ADD_VEC(fused_add_vec_i8_i16, int8_t, int16_t)
FUSED_ADD_VEC(fused_add_vec_i16_i8, int16_t, int8_t)
FUSED_ADD_VEC(fused_add_vec_i16_i16, int16_t, int16_t)
#endif

static void epilogue_rows(const qir_epilogue *e, const int32_t *acc, int64_t lda, int64_t m0, int64_t m1) {
    const int64_t n = e->n, rows = m1 - m0;
    char *out = (char *)e->out + m0 * n * (e->out_bits / 8);
    if (e->kind == 1) {
        if (e->out_bits == 8)
            qir_requant_rows_i8(acc, lda, n, e->rq, e->fast, (int8_t *)out, 0, rows);
        else
            qir_requant_rows_i16(acc, lda, n, e->rq, e->fast, (int16_t *)out, 0, rows);
        return;
    }
    const char *add = (const char *)e->addend + m0 * n * (e->add_bits / 8);
#if QIR_VNNI
    if (e->rq_mid && e->rq_add) {
        if (e->add_bits == 8 && e->out_bits == 8) fused_add_vec_i8_i8(e, acc, lda, (const int8_t *)add, (int8_t *)out, rows);
        else if (e->add_bits == 8) fused_add_vec_i8_i16(e, acc, lda, (const int8_t *)add, (int16_t *)out, rows);
        else if (e->out_bits == 8) fused_add_vec_i16_i8(e, acc, lda, (const int16_t *)add, (int8_t *)out, rows);
        else fused_add_vec_i16_i16(e, acc, lda, (const int16_t *)add, (int16_t *)out, rows);
        return;
    }
#endif
#define QIR_FA(F, AT, OT)                                                                                 \
    F(acc, lda, n, (const AT *)add, e->bias, e->mult, e->half, e->shift, e->add_mult, e->add_half, e->add_shift, \
      e->p, e->lo_i, e->hi_i, (OT *)out, 0, rows)
    if (e->add_bits == 8 && e->out_bits == 8) QIR_FA(qir_fused_add_rows_i8_i8, int8_t, int8_t);
    else if (e->add_bits == 8) QIR_FA(qir_fused_add_rows_i8_i16, int8_t, int16_t);
    else if (e->out_bits == 8) QIR_FA(qir_fused_add_rows_i16_i8, int16_t, int8_t);
    else QIR_FA(qir_fused_add_rows_i16_i16, int16_t, int16_t);
#undef QIR_FA
}

#if QIR_VNNI
/* One tile of the int8 matrix product: MR rows of a times NB panels of 16 columns, over the whole
 * reduction (kq groups of 4). vpdpbusd multiplies unsigned by signed bytes, so a holds each code
 * flipped to a + 128 (xor 0x80, done by the caller's copy into its chunk buffer) and 128 * sum_k b[k, n]
 * (comp) is subtracted at the end: exact in int32 arithmetic modulo 2**32, so exact whenever the
 * true sum fits int32 (the lowering's bound).
 * Reads a[i * lda + 4q + t] (t < 4, q < kq: the caller checks lda >= 4 kq) and bp[(j kq + q) 64 + 0..63]. */
/* QIR_DPBUSD: native_simd.h */
#define QIR_ROW_DECL(i)                                                                              \
    __m512i c##i##0 = k0, c##i##1 = k1, c##i##2 = k2, c##i##3 = k3;                                  \
    if (MR > i && q0) {                                                                              \
        c##i##0 = _mm512_loadu_si512((const void *)(c + i * ldc));                                   \
        if (NB > 1) c##i##1 = _mm512_loadu_si512((const void *)(c + i * ldc + 16));                  \
        if (NB > 2) c##i##2 = _mm512_loadu_si512((const void *)(c + i * ldc + 32));                  \
        if (NB > 3) c##i##3 = _mm512_loadu_si512((const void *)(c + i * ldc + 48));                  \
    }
#define QIR_ROW_STEP(i)                                                                              \
    if (MR > i) {                                                                                    \
        int32_t av;                                                                                  \
        memcpy(&av, a + i * lda + 4 * q, 4);                                                         \
        const __m512i ab = _mm512_set1_epi32(av);                                                    \
        QIR_DPBUSD(c##i##0, ab, b0);                                              \
        if (NB > 1) QIR_DPBUSD(c##i##1, ab, b1);                                  \
        if (NB > 2) QIR_DPBUSD(c##i##2, ab, b2);                                  \
        if (NB > 3) QIR_DPBUSD(c##i##3, ab, b3);                                  \
    }
#define QIR_ROW_STORE(i)                                                                             \
    if (MR > i) {                                                                                    \
        _mm512_storeu_si512((void *)(c + i * ldc), c##i##0);                                         \
        if (NB > 1) _mm512_storeu_si512((void *)(c + i * ldc + 16), c##i##1);                        \
        if (NB > 2) _mm512_storeu_si512((void *)(c + i * ldc + 32), c##i##2);                        \
        if (NB > 3) _mm512_storeu_si512((void *)(c + i * ldc + 48), c##i##3);                        \
    }

static inline __attribute__((always_inline)) void vnni_tile(const int8_t *a, int64_t lda, const int8_t *bp,
                                                            int64_t kq, int64_t q0, int64_t q1,
                                                            const int32_t *comp, int32_t *c, int64_t ldc,
                                                            const int MR, const int NB) {
    const __m512i z = _mm512_setzero_si512();
    /* the first slice of the reduction starts from -comp, the others from the partial sums in c */
    const __m512i k0 = q0 ? z : _mm512_sub_epi32(z, _mm512_loadu_si512((const void *)comp));
    const __m512i k1 = q0 || NB < 2 ? z : _mm512_sub_epi32(z, _mm512_loadu_si512((const void *)(comp + 16)));
    const __m512i k2 = q0 || NB < 3 ? z : _mm512_sub_epi32(z, _mm512_loadu_si512((const void *)(comp + 32)));
    const __m512i k3 = q0 || NB < 4 ? z : _mm512_sub_epi32(z, _mm512_loadu_si512((const void *)(comp + 48)));
    QIR_ROW_DECL(0) QIR_ROW_DECL(1) QIR_ROW_DECL(2) QIR_ROW_DECL(3) QIR_ROW_DECL(4) QIR_ROW_DECL(5)
    const int8_t *p0 = bp, *p1 = bp + kq * 64, *p2 = bp + 2 * kq * 64, *p3 = bp + 3 * kq * 64;
    for (int64_t q = q0; q < q1; ++q) {
        const __m512i b0 = _mm512_loadu_si512((const void *)(p0 + q * 64));
        const __m512i b1 = NB > 1 ? _mm512_loadu_si512((const void *)(p1 + q * 64)) : z;
        const __m512i b2 = NB > 2 ? _mm512_loadu_si512((const void *)(p2 + q * 64)) : z;
        const __m512i b3 = NB > 3 ? _mm512_loadu_si512((const void *)(p3 + q * 64)) : z;
        QIR_ROW_STEP(0) QIR_ROW_STEP(1) QIR_ROW_STEP(2) QIR_ROW_STEP(3) QIR_ROW_STEP(4) QIR_ROW_STEP(5)
    }
    QIR_ROW_STORE(0) QIR_ROW_STORE(1) QIR_ROW_STORE(2) QIR_ROW_STORE(3) QIR_ROW_STORE(4) QIR_ROW_STORE(5)
}
#undef QIR_ROW_DECL
#undef QIR_ROW_STEP
#undef QIR_ROW_STORE

#define QIR_TILE_CASE(M, N) \
    case (M) * 8 + (N): vnni_tile(a, lda, bp, kq, q0, q1, comp, c, ldc, M, N); break;
static void vnni_tile_any(const int8_t *a, int64_t lda, const int8_t *bp, int64_t kq, int64_t q0, int64_t q1,
                          const int32_t *comp, int32_t *c, int64_t ldc, int mr, int nb) {
    switch (mr * 8 + nb) {
        QIR_TILE_CASE(6, 4) QIR_TILE_CASE(6, 3) QIR_TILE_CASE(6, 2) QIR_TILE_CASE(6, 1)
        QIR_TILE_CASE(5, 4) QIR_TILE_CASE(5, 3) QIR_TILE_CASE(5, 2) QIR_TILE_CASE(5, 1)
        QIR_TILE_CASE(4, 4) QIR_TILE_CASE(4, 3) QIR_TILE_CASE(4, 2) QIR_TILE_CASE(4, 1)
        QIR_TILE_CASE(3, 4) QIR_TILE_CASE(3, 3) QIR_TILE_CASE(3, 2) QIR_TILE_CASE(3, 1)
        QIR_TILE_CASE(2, 4) QIR_TILE_CASE(2, 3) QIR_TILE_CASE(2, 2) QIR_TILE_CASE(2, 1)
        QIR_TILE_CASE(1, 4) QIR_TILE_CASE(1, 3) QIR_TILE_CASE(1, 2) QIR_TILE_CASE(1, 1)
        default: break;
    }
}
#undef QIR_TILE_CASE
#endif

#if QIR_VNNI
/* Rows of a chunk of the product (ua: mr_total rows of 4 kq unsigned bytes): the reduction in
 * slices of 256 bytes so that one slice of four weight panels (16 KiB) stays in L1 across all
 * the chunk's tiles; the partial sums wait in acc (rows * nblocks * 16 int32, in L2). */
static void vnni_chunk(const int8_t *ua, int64_t rows, const int8_t *bp, int64_t kq, int64_t nblocks,
                       const int32_t *comp, int32_t *acc) {
    const int64_t lda = 4 * kq, ldc = nblocks * 16;
    for (int64_t q0 = 0; q0 < kq; q0 += 64) {
        const int64_t q1 = q0 + 64 < kq ? q0 + 64 : kq;
        for (int64_t j = 0; j < nblocks; j += 4) {
            const int nb = (int)(nblocks - j < 4 ? nblocks - j : 4);
            for (int64_t m = 0; m < rows; m += 6) {
                const int mr = (int)(rows - m < 6 ? rows - m : 6);
                vnni_tile_any(ua + m * lda, lda, bp + j * kq * 64, kq, q0, q1, comp + j * 16, acc + m * ldc + j * 16,
                              ldc, mr, nb);
            }
        }
    }
}

/* Rows per chunk: its unsigned codes and its int32 sums each within about 128 KiB (L2). */
static int64_t chunk_rows(int64_t kq, int64_t nblocks) {
    const int64_t by_a = 128 * 1024 / (4 * kq), by_c = 128 * 1024 / (64 * nblocks);
    int64_t mc = (by_a < by_c ? by_a : by_c) / 6 * 6;
    return mc < 6 ? 6 : (mc > 240 ? 240 : mc);
}

/* Rows per chunk for rows rows: as few chunks as chunk_rows allows, of equal size (a multiple of the
 * 6-row tile but the last): every chunk streams the whole weight through the cache once, so 49 rows
 * under a limit of 24 go as 18 + 18 + 13, not 24 + 24 + 1 (a weight pass for one row). */
static int64_t balanced_chunk(int64_t rows, int64_t mc) {
    const int64_t chunks = (rows + mc - 1) / mc;
    const int64_t even = (rows + chunks - 1) / chunks;
    return (even + 5) / 6 * 6 < mc ? (even + 5) / 6 * 6 : mc;
}
#endif

/* codes = epilogue(a @ b) for rows [r0, r1) of a (int8, row stride lda >= 4 kq), b packed by
 * native.py's pack_vnni into nblocks panels of (kq, 16, 4) bytes, comp = 128 * column sums of b
 * (nblocks * 16 int32). Rows go in chunks whose int32 accumulators (a chunk x nblocks * 16
 * buffer of the thread's qir_scratch) stay in cache until the epilogue requantizes them; within a chunk, panels go in groups
 * that fit in L2 so each is read from memory once per chunk. Returns 1 without the VNNI build or
 * on allocation failure, else 0. */
int qir_gemm_vnni(const int8_t *a, int64_t lda, const int8_t *bp, int64_t kq, int64_t nblocks,
                  const int32_t *comp, const qir_epilogue *e, int64_t r0, int64_t r1) {
#if QIR_VNNI
    if (r1 <= r0) return 0;
    const int64_t mc = balanced_chunk(r1 - r0, chunk_rows(kq, nblocks));
    int8_t *ua = (int8_t *)qir_scratch(0, (size_t)(mc * 4 * kq));
    int32_t *acc = (int32_t *)qir_scratch(1, sizeof(int32_t) * (size_t)(mc * nblocks * 16));
    if (!acc || !ua) return 1;
    for (int64_t m0 = r0; m0 < r1; m0 += mc) {
        const int64_t m1 = m0 + mc < r1 ? m0 + mc : r1;
        for (int64_t m = m0; m < m1; ++m) copy_codes(ua + (m - m0) * 4 * kq, a + m * lda, 4 * kq, 0x80);
        vnni_chunk(ua, m1 - m0, bp, kq, nblocks, comp, acc);
        epilogue_rows(e, acc, nblocks * 16, m0, m1);
    }
    return 0;
#else
    (void)a, (void)lda, (void)bp, (void)kq, (void)nblocks, (void)comp, (void)e, (void)r0, (void)r1;
    return 1;
#endif
}

/* qir_gemm_vnni split by output channels instead of rows: all m rows of a, the packed panels
 * [j0, j1) (16 output channels each) and their epilogue. For fewer rows than one register tile (a
 * batch-1 linear has one), where a split by rows has nothing to cut and one thread would stream the
 * whole weight: each part reads only its own panels. Every output channel is computed as in
 * qir_gemm_vnni (the same tiles over its panel, the same epilogue on its sums), so the codes do not
 * depend on the split. Same packing and returns. */
int qir_gemm_vnni_cols(const int8_t *a, int64_t lda, int64_t m, const int8_t *bp, int64_t kq, int64_t nblocks,
                       const int32_t *comp, const qir_epilogue *e, int64_t j0, int64_t j1) {
#if QIR_VNNI
    if (j1 > nblocks) j1 = nblocks;
    const int64_t nb = j1 - j0, n0 = 16 * j0, n1 = 16 * j1 < e->n ? 16 * j1 : e->n;
    if (nb <= 0 || m <= 0 || n1 <= n0) return 0;
    const int64_t mc = balanced_chunk(m, chunk_rows(kq, nb));
    int8_t *ua = (int8_t *)qir_scratch(0, (size_t)(mc * 4 * kq));
    int32_t *acc = (int32_t *)qir_scratch(1, sizeof(int32_t) * (size_t)(mc * nb * 16));
    if (!acc || !ua) return 1;
    const int64_t ob = e->out_bits / 8, ab = e->add_bits / 8;
    /* the epilogue of channels [n0, n1): its per-channel parameters from channel n0 on (packed ones
     * from block j0 on); it runs one row at a time, so the row stride of out and addend does not enter */
    qir_epilogue sub = *e;
    sub.n = n1 - n0;
    sub.rq = e->rq + j0;
    if (e->kind == 2) {
        sub.bias = e->bias + n0, sub.mult = e->mult + n0, sub.half = e->half + n0, sub.shift = e->shift + n0;
        sub.lo_i = e->lo_i + n0, sub.hi_i = e->hi_i + n0;
        if (e->rq_mid) sub.rq_mid = e->rq_mid + j0; /* rq_add: one block for every channel */
    }
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t r = m0; r < m1; ++r) copy_codes(ua + (r - m0) * 4 * kq, a + r * lda, 4 * kq, 0x80);
        vnni_chunk(ua, m1 - m0, bp + j0 * kq * 64, kq, nb, comp + n0, acc);
        for (int64_t r = m0; r < m1; ++r) { /* row r's output (and addend) from channel n0 on */
            sub.out = (char *)e->out + (r * e->n + n0) * ob;
            if (e->kind == 2) sub.addend = (const char *)e->addend + (r * e->n + n0) * ab;
            epilogue_rows(&sub, acc + (r - m0) * nb * 16, nb * 16, 0, 1);
        }
    }
    return 0;
#else
    (void)a, (void)lda, (void)m, (void)bp, (void)kq, (void)nblocks, (void)comp, (void)e, (void)j0, (void)j1;
    return 1;
#endif
}

/* The int8 conv as one native pass per chunk of output pixels: im2col of the chunk into a cached
 * buffer (chunk x 4 kq bytes, the columns past KH*KW*C zero), its matrix product with the packed
 * weight, then the epilogue; the columns never go through memory. Rows are output pixels
 * (n, oy, ox) in [r0, r1). Same packing, exactness and returns as qir_gemm_vnni. */
int qir_conv_vnni(const int8_t *x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                  int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow, const int8_t *bp, int64_t kq,
                  int64_t nblocks, const int32_t *comp, const qir_epilogue *e, int64_t r0, int64_t r1) {
#if QIR_VNNI
    const qir_geom g = {h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow};
    if (r1 <= r0) return 0;
    const int64_t mc = balanced_chunk(r1 - r0, chunk_rows(kq, nblocks));
    /* the columns past KH*KW*C (up to 4 kq) keep whatever the buffer held: they meet the packed
     * weight's zero rows, so they add nothing to any sum */
    int8_t *cols = (int8_t *)qir_scratch(0, (size_t)(mc * 4 * kq));
    int32_t *acc = (int32_t *)qir_scratch(1, sizeof(int32_t) * (size_t)(mc * nblocks * 16));
    if (!cols || !acc) return 1;
    for (int64_t m0 = r0; m0 < r1; m0 += mc) {
        const int64_t m1 = m0 + mc < r1 ? m0 + mc : r1;
        im2col_range(x, &g, m0, m1, cols, 4 * kq, 0x80);
        vnni_chunk(cols, m1 - m0, bp, kq, nblocks, comp, acc);
        epilogue_rows(e, acc, nblocks * 16, m0, m1);
    }
    return 0;
#else
    (void)x, (void)h, (void)w, (void)c, (void)kh, (void)kw, (void)sh, (void)sw, (void)ph, (void)pw, (void)dh, (void)dw;
    (void)oh, (void)ow, (void)bp, (void)kq, (void)nblocks, (void)comp, (void)e, (void)r0, (void)r1;
    return 1;
#endif
}

/* The quantize kernel on float32 NCHW x: codes = clamp(floor(v) + (v - floor(v) >= 0.5)) with
 * v = x / scale, one IEEE float32 division (what quant.py computes with torch), written as NHWC
 * (out[(n, p, ch)] for pixel p of hw). Rows are pixels (n, p) in [r0, r1), all channels of each:
 * a part writes whole NHWC pixels, so two threads never share an output cache line inside a call's
 * grain (split by planes, every thread wrote every line: a c = 3 image's bytes interleave). Within
 * a block of up to 64 pixels of one image, each channel's codes come out of one vectorised loop over
 * its contiguous plane, then go to their NHWC places. Returns the number of non-finite inputs met
 * (the caller then takes the torch path, whose NaN handling this does not copy). */
#define QUANTIZE_PIXELS(NAME, OUT_T, LO, HI)                                                             \
    /* n codes of one channel's plane xp into dst; returns the non-finite inputs among them */          \
    static inline int64_t NAME##_plane(const float *restrict xp, int64_t n, float scale,                \
                                       OUT_T *restrict dst) {                                            \
        int64_t bad = 0;                                                                                 \
        for (int64_t i = 0; i < n; ++i) {                                                                \
            const float v = xp[i] / scale;                                                               \
            bad += !isfinite(v);                                                                         \
            float f = floorf(v);                                                                         \
            f += (v - f >= 0.5f) ? 1.0f : 0.0f;                                                          \
            f = f < (LO) ? (LO) : (f > (HI) ? (HI) : f);                                                 \
            dst[i] = (OUT_T)(isfinite(f) ? (int32_t)f : 0);                                              \
        }                                                                                                \
        return bad;                                                                                      \
    }                                                                                                    \
    int64_t NAME(const float *restrict x, int64_t c, int64_t hw, float scale, OUT_T *restrict out,       \
                 int64_t r0, int64_t r1) {                                                               \
        int64_t bad = 0;                                                                                 \
        OUT_T codes[3][64];                                                                              \
        for (int64_t q0 = r0; q0 < r1;) {                                                                \
            const int64_t b = q0 / hw, p0 = q0 % hw;                                                     \
            int64_t n = hw - p0 < 64 ? hw - p0 : 64;                                                     \
            if (r1 - q0 < n) n = r1 - q0;                                                                \
            OUT_T *o = out + q0 * c;                                                                     \
            if (c == 3) {                                                                                \
                /* an image: the three planes' codes, then one interleaving loop with constant strides  \
                 * (the compiler turns it into vector permutes; a loop per channel with stride c stores \
                 * byte by byte) */                                                                      \
                for (int64_t ch = 0; ch < 3; ++ch)                                                       \
                    bad += NAME##_plane(x + (b * 3 + ch) * hw + p0, n, scale, codes[ch]);                \
                for (int64_t i = 0; i < n; ++i) {                                                        \
                    o[3 * i] = codes[0][i];                                                              \
                    o[3 * i + 1] = codes[1][i];                                                          \
                    o[3 * i + 2] = codes[2][i];                                                          \
                }                                                                                        \
            } else {                                                                                     \
                for (int64_t ch = 0; ch < c; ++ch) {                                                     \
                    bad += NAME##_plane(x + (b * c + ch) * hw + p0, n, scale, codes[0]);                 \
                    for (int64_t i = 0; i < n; ++i) o[i * c + ch] = codes[0][i];                         \
                }                                                                                        \
            }                                                                                            \
            q0 += n;                                                                                     \
        }                                                                                                \
        return bad;                                                                                      \
    }

QUANTIZE_PIXELS(qir_quantize_pixels_i8, int8_t, -128.0f, 127.0f)
QUANTIZE_PIXELS(qir_quantize_pixels_i16, int16_t, -32768.0f, 32767.0f)

/* ---------------------------------------------------------------------------------------------
 * Row-range tasks for the thread pool (native_pool.c): each entry point above with its arguments
 * packed in one int64 array (pointers as integers, the quantize scale as its float32 bits), so one
 * exported qir_run splits any of them across threads. native.py packs the arrays in the order of
 * the entry point's parameters, by the names qir_task_name lists. */
#define QIR_A(T, i) ((T)(intptr_t)a[i])
#define QIR_RQ(i) QIR_A(const qir_rqblock *, i)
#define QIR_I(i) QIR_A(const int64_t *, i)

#define TASK_REQUANT(T, OUT_T)                                                                              \
    static int64_t task_requant_##T(const int64_t *a, int64_t r0, int64_t r1) {                             \
        qir_requant_rows_##T(QIR_A(const int32_t *, 0), a[1], a[2], QIR_RQ(3), a[4], QIR_A(OUT_T *, 5), r0, r1); \
        return 0;                                                                                           \
    }
TASK_REQUANT(i8, int8_t)
TASK_REQUANT(i16, int16_t)

#define TASK_FUSED_ADD(A, O, ADD_T, OUT_T)                                                                    \
    static int64_t task_fused_add_##A##_##O(const int64_t *a, int64_t r0, int64_t r1) {                       \
        qir_fused_add_rows_##A##_##O(QIR_A(const int32_t *, 0), a[1], a[2], QIR_A(const ADD_T *, 3), QIR_I(4), \
                                     QIR_I(5), QIR_I(6), QIR_I(7), a[8], a[9], a[10], a[11], QIR_I(12),       \
                                     QIR_I(13), QIR_A(OUT_T *, 14), r0, r1);                                  \
        return 0;                                                                                             \
    }
TASK_FUSED_ADD(i8, i8, int8_t, int8_t)
TASK_FUSED_ADD(i8, i16, int8_t, int16_t)
TASK_FUSED_ADD(i16, i8, int16_t, int8_t)
TASK_FUSED_ADD(i16, i16, int16_t, int16_t)

#define TASK_DW(T, OUT_T)                                                                                     \
    static int64_t task_dw_##T(const int64_t *a, int64_t r0, int64_t r1) {                                    \
        return qir_dw_rows_##T(QIR_A(const int8_t *, 0), a[1], a[2], a[3], QIR_A(const int8_t *, 4), a[5], a[6], \
                               a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], QIR_RQ(15), a[16],          \
                               QIR_A(OUT_T *, 17), r0, r1);                                                  \
    }
TASK_DW(i8, int8_t)
TASK_DW(i16, int16_t)

#define TASK_DW_VNNI(T, OUT_T)                                                                                  \
    static int64_t task_dw_vnni_##T(const int64_t *a, int64_t r0, int64_t r1) {                                   \
        return qir_dw_vnni_##T(QIR_A(const int8_t *, 0), a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], \
                               a[11], a[12], a[13], QIR_A(const int8_t *, 14), QIR_A(const int32_t *, 15), a[16],     \
                               a[17], QIR_RQ(18), a[19], QIR_A(OUT_T *, 20), r0, r1);                                \
    }
TASK_DW_VNNI(i8, int8_t)
TASK_DW_VNNI(i16, int16_t)

static int64_t task_im2col_i8(const int64_t *a, int64_t r0, int64_t r1) {
    qir_im2col_i8(QIR_A(const int8_t *, 0), a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
                  a[12], a[13], QIR_A(int8_t *, 14), a[15], r0, r1);
    return 0;
}

#define TASK_MAXPOOL(T, ET)                                                                                  \
    static int64_t task_maxpool_##T(const int64_t *a, int64_t r0, int64_t r1) {                              \
        qir_maxpool_rows_##T(QIR_A(const ET *, 0), a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], \
                             a[11], a[12], a[13], QIR_A(ET *, 14), r0, r1);                                 \
        return 0;                                                                                            \
    }
TASK_MAXPOOL(i8, int8_t)
TASK_MAXPOOL(i16, int16_t)

static int64_t task_gemm_vnni(const int64_t *a, int64_t r0, int64_t r1) {
    return qir_gemm_vnni(QIR_A(const int8_t *, 0), a[1], QIR_A(const int8_t *, 2), a[3], a[4],
                         QIR_A(const int32_t *, 5), QIR_A(const qir_epilogue *, 6), r0, r1);
}

static int64_t task_gemm_vnni_cols(const int64_t *a, int64_t j0, int64_t j1) {
    return qir_gemm_vnni_cols(QIR_A(const int8_t *, 0), a[1], a[2], QIR_A(const int8_t *, 3), a[4], a[5],
                              QIR_A(const int32_t *, 6), QIR_A(const qir_epilogue *, 7), j0, j1);
}

static int64_t task_conv_vnni(const int64_t *a, int64_t r0, int64_t r1) {
    return qir_conv_vnni(QIR_A(const int8_t *, 0), a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                         a[11], a[12], a[13], QIR_A(const int8_t *, 14), a[15], a[16], QIR_A(const int32_t *, 17),
                         QIR_A(const qir_epilogue *, 18), r0, r1);
}

#define TASK_QUANTIZE(T, OUT_T)                                                                              \
    static int64_t task_quantize_##T(const int64_t *a, int64_t r0, int64_t r1) {                             \
        const uint32_t bits = (uint32_t)a[3];                                                                \
        float scale;                                                                                         \
        memcpy(&scale, &bits, sizeof scale);                                                                 \
        return qir_quantize_pixels_##T(QIR_A(const float *, 0), a[1], a[2], scale, QIR_A(OUT_T *, 4), r0, r1); \
    }
TASK_QUANTIZE(i8, int8_t)
TASK_QUANTIZE(i16, int16_t)

#define TASK_SUM_PIXELS(T, ET)                                                                     \
    static int64_t task_sum_pixels_##T(const int64_t *a, int64_t r0, int64_t r1) {                 \
        qir_sum_pixels_##T(QIR_A(const ET *, 0), a[1], a[2], QIR_A(int32_t *, 3), r0, r1);          \
        return 0;                                                                                  \
    }
TASK_SUM_PIXELS(i8, int8_t)
TASK_SUM_PIXELS(i16, int16_t)

static int64_t task_grid_requant(const int64_t *a, int64_t r0, int64_t r1) {
    const uint32_t bits = (uint32_t)a[8];
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    qir_grid_requant_rows(QIR_A(const float *, 0), a[1], a[2], QIR_A(const double *, 3), QIR_A(const double *, 4),
                          QIR_A(const float *, 5), a[6], a[7], scale, QIR_A(float *, 9), QIR_A(float *, 10), r0, r1);
    return 0;
}

static int64_t task_grid_codes(const int64_t *a, int64_t r0, int64_t r1) {
    const uint32_t bits = (uint32_t)a[3];
    float inv;
    memcpy(&inv, &bits, sizeof inv);
    qir_grid_codes_rows(QIR_A(const float *, 0), a[1], a[2], inv, QIR_A(float *, 4), r0, r1);
    return 0;
}

static int64_t task_grid_weight_codes(const int64_t *a, int64_t r0, int64_t r1) {
    qir_grid_weight_codes_rows(QIR_A(const float *, 0), a[1], a[2], QIR_A(const float *, 3), QIR_A(const float *, 4),
                               a[5], a[6], QIR_A(float *, 7), QIR_A(float *, 8), r0, r1);
    return 0;
}

#define TASK_WEIGHT_CODES(T, OUT_T)                                                                            \
    static int64_t task_weight_codes_##T(const int64_t *a, int64_t r0, int64_t r1) {                           \
        const uint32_t den_bits = (uint32_t)a[6], eps_bits = (uint32_t)a[7];                                   \
        float den, eps;                                                                                        \
        memcpy(&den, &den_bits, sizeof den);                                                                   \
        memcpy(&eps, &eps_bits, sizeof eps);                                                                   \
        return qir_weight_codes_rows_##T(QIR_A(const float *, 0), a[1], a[2], QIR_A(const float *, 3),         \
                                         QIR_A(const float *, 4), QIR_A(const float *, 5), den, eps,           \
                                         QIR_A(float *, 8), QIR_A(OUT_T *, 9), QIR_A(int64_t *, 10), r0, r1);  \
    }
TASK_WEIGHT_CODES(i8, int8_t)
TASK_WEIGHT_CODES(i16, int16_t)

static int64_t task_grid_fused_add(const int64_t *a, int64_t r0, int64_t r1) {
    const uint32_t inv_bits = (uint32_t)a[9], scale_bits = (uint32_t)a[13];
    float inv, scale;
    memcpy(&inv, &inv_bits, sizeof inv);
    memcpy(&scale, &scale_bits, sizeof scale);
    qir_grid_fused_add_rows(QIR_A(const float *, 0), QIR_A(const float *, 1), a[2], a[3], QIR_A(const float *, 4),
                            QIR_A(const float *, 5), QIR_A(const double *, 6), QIR_A(const double *, 7),
                            QIR_A(const double *, 8), inv, a[10], a[11], a[12], scale, QIR_A(float *, 14),
                            QIR_A(float *, 15), r0, r1);
    return 0;
}

static int64_t task_grid_abs_row_max(const int64_t *a, int64_t r0, int64_t r1) {
    return qir_grid_abs_row_max(QIR_A(const float *, 0), a[1], r0, r1);
}

static const struct {
    const char *name; /* the entry point's name */
    qir_rows_fn fn;
    int64_t nargs; /* its parameters before r0, r1 */
} qir_tasks[] = {
    {"qir_requant_rows_i8", task_requant_i8, 6},
    {"qir_requant_rows_i16", task_requant_i16, 6},
    {"qir_fused_add_rows_i8_i8", task_fused_add_i8_i8, 15},
    {"qir_fused_add_rows_i8_i16", task_fused_add_i8_i16, 15},
    {"qir_fused_add_rows_i16_i8", task_fused_add_i16_i8, 15},
    {"qir_fused_add_rows_i16_i16", task_fused_add_i16_i16, 15},
    {"qir_dw_rows_i8", task_dw_i8, 18},
    {"qir_dw_rows_i16", task_dw_i16, 18},
    {"qir_dw_vnni_i8", task_dw_vnni_i8, 21},
    {"qir_dw_vnni_i16", task_dw_vnni_i16, 21},
    {"qir_im2col_i8", task_im2col_i8, 16},
    {"qir_maxpool_rows_i8", task_maxpool_i8, 15},
    {"qir_maxpool_rows_i16", task_maxpool_i16, 15},
    {"qir_gemm_vnni", task_gemm_vnni, 7},
    {"qir_gemm_vnni_cols", task_gemm_vnni_cols, 8},
    {"qir_conv_vnni", task_conv_vnni, 19},
    {"qir_quantize_pixels_i8", task_quantize_i8, 5},
    {"qir_quantize_pixels_i16", task_quantize_i16, 5},
    {"qir_sum_pixels_i8", task_sum_pixels_i8, 4},
    {"qir_sum_pixels_i16", task_sum_pixels_i16, 4},
    {"qir_grid_requant_rows", task_grid_requant, 11},
    {"qir_grid_codes_rows", task_grid_codes, 5},
    {"qir_grid_weight_codes_rows", task_grid_weight_codes, 9},
    {"qir_weight_codes_rows_i8", task_weight_codes_i8, 11},
    {"qir_weight_codes_rows_i16", task_weight_codes_i16, 11},
    {"qir_grid_fused_add_rows", task_grid_fused_add, 16},
    {"qir_grid_abs_row_max", task_grid_abs_row_max, 2},
};
#define QIR_NTASKS ((int64_t)(sizeof qir_tasks / sizeof qir_tasks[0]))

/* The name of task id, "" past the last (native.py maps names to ids once, at load). */
const char *qir_task_name(int64_t id) { return id >= 0 && id < QIR_NTASKS ? qir_tasks[id].name : ""; }

/* Task id over rows [0, rows) on up to nt threads, about per parts per thread cut at multiples of
 * grain (qir_pool_run); returns the sum of the parts' results (a kernel's failure flag or count), or
 * -1 for an unknown id or a wrong nargs. */
int64_t qir_run(int64_t id, const int64_t *argv, int64_t nargs, int64_t rows, int64_t nt, int64_t grain,
                int64_t per) {
    if (id < 0 || id >= QIR_NTASKS || nargs != qir_tasks[id].nargs) return -1;
    return qir_pool_run(qir_tasks[id].fn, argv, rows, nt, grain, per);
}
