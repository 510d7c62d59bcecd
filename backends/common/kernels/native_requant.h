/* The requantization of int32 accumulators in integer arithmetic, shared by the native kernels
 * (native.c, native_dw.c): out = clamp((acc * M + off) >> s, lo, hi) per channel, with
 * off = bias * M + 2**(s-1) (the bias and the half-up rounding folded into one int64), the exact
 * rule of qir.ir.numerics.requantize (int64 products, arithmetic right shift: floor, so adding
 * 2**(s-1) first rounds half up), with the saturation and the activation clamp as one range.
 *
 * conv.py's pack_requant lays the parameters out per block of 16 channels (qir_rqblock) in one of
 * two modes, chosen per layer:
 *   fast (1): mul = M << t, off = off << t, sh = s - 32 + t with t = max(0, 32 - s), so that
 *     (acc * M + off) >> s == ((acc * mul + off) >> 32) >> sh; the high 32 bits of the 64-bit sums
 *     are the int32 codes before the last shift, and a vector of 16 channels needs two 32x32->64
 *     multiplies (vpmuldq), two 64-bit adds, one blend of the high halves and one 32-bit shift.
 *     Taken when every channel has mul < 2**31 and 2**31 * mul + |off| < 2**63 (no int64 overflow
 *     for any int32 accumulator): on both marches whenever M / 2**s < 1/2.
 *   general (0): mul = M, off, sh = s (<= 62): the int64 sum shifted by s, clamped in 64 bits. Sums
 *     that overflow int64 wrap (-fwrapv, vpaddq) exactly as the int64 reference does.
 * Lanes of a block past the layer's channels hold zeros and are never stored. */
#ifndef QIR_NATIVE_REQUANT_H
#define QIR_NATIVE_REQUANT_H
#include <stdint.h>

#include "native_simd.h"

#if !QIR_VNNI && defined(__AVX2__)
#include <immintrin.h>
#define QIR_AVX2 1
#else
#define QIR_AVX2 0
#endif

typedef struct {
    int32_t mul[16], sh[16], lo[16], hi[16];
    int64_t off[16]; /* channels 0, 2, .., 14, then 1, 3, .., 15 (the even / odd 64-bit lanes) */
} qir_rqblock;       /* 384 bytes: conv.py's pack_requant writes 48 int64 per block */

/* Channel k (< 16) of block b: the scalar rule every vector path below equals. */
static inline int32_t rq_scalar(const qir_rqblock *b, int k, int32_t acc, int64_t fast) {
    int64_t v = (int64_t)acc * b->mul[k] + b->off[(k & 1) * 8 + (k >> 1)];
    v = fast ? (v >> 32) >> b->sh[k] : v >> b->sh[k];
    v = v < b->lo[k] ? b->lo[k] : v;
    return (int32_t)(v > b->hi[k] ? b->hi[k] : v);
}

#if QIR_VNNI
/* One block's parameters in registers (a loop over pixels or rows loads them once). */
typedef struct {
    __m512i mul, mul_o, off_e, off_o, sh, lo, hi;
} qir_rqv;

static inline qir_rqv rqv_load(const qir_rqblock *b) {
    qir_rqv q;
    q.mul = _mm512_loadu_si512((const void *)b->mul);
    q.mul_o = _mm512_srli_epi64(q.mul, 32);
    q.off_e = _mm512_loadu_si512((const void *)b->off);
    q.off_o = _mm512_loadu_si512((const void *)(b->off + 8));
    q.sh = _mm512_loadu_si512((const void *)b->sh);
    q.lo = _mm512_loadu_si512((const void *)b->lo);
    q.hi = _mm512_loadu_si512((const void *)b->hi);
    return q;
}

/* 16 accumulators -> 16 clamped int32 codes. vpmuldq multiplies the low (signed) halves of the
 * 64-bit lanes: the even channels as they are, the odd ones after a 32-bit right shift. */
static inline __attribute__((always_inline)) __m512i rqv_apply(__m512i acc, const qir_rqv *q, int64_t fast) {
    const __m512i pe = _mm512_add_epi64(_mm512_mul_epi32(acc, q->mul), q->off_e);
    const __m512i po = _mm512_add_epi64(_mm512_mul_epi32(_mm512_srli_epi64(acc, 32), q->mul_o), q->off_o);
    if (fast) {
        /* lane 2j: the high half of pe[j]; lane 2j + 1: the high half of po[j] (already in place) */
        const __m512i v = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
        return _mm512_min_epi32(_mm512_max_epi32(_mm512_srav_epi32(v, q->sh), q->lo), q->hi);
    }
    const __m512i lo32 = _mm512_set1_epi64(0xFFFFFFFF);
    __m512i ve = _mm512_srav_epi64(pe, _mm512_and_si512(q->sh, lo32));
    __m512i vo = _mm512_srav_epi64(po, _mm512_srli_epi64(q->sh, 32));
    /* bounds sign-extended to 64 bits: even lanes from the low halves, odd from the high */
    ve = _mm512_min_epi64(_mm512_max_epi64(ve, _mm512_srai_epi64(_mm512_slli_epi64(q->lo, 32), 32)),
                          _mm512_srai_epi64(_mm512_slli_epi64(q->hi, 32), 32));
    vo = _mm512_min_epi64(_mm512_max_epi64(vo, _mm512_srai_epi64(q->lo, 32)), _mm512_srai_epi64(q->hi, 32));
    return _mm512_mask_blend_epi32(0xAAAA, ve, _mm512_slli_epi64(vo, 32));
}
#endif

#if QIR_AVX2
/* Half h (channels 8h .. 8h + 7) of a block, fast mode (AVX2 has no 64-bit arithmetic shift: the
 * general mode takes rq_scalar). */
typedef struct {
    __m256i mul, mul_o, off_e, off_o, sh, lo, hi;
} qir_rq8;

static inline qir_rq8 rq8_load(const qir_rqblock *b, int h) {
    qir_rq8 q;
    q.mul = _mm256_loadu_si256((const __m256i *)(b->mul + 8 * h));
    q.mul_o = _mm256_srli_epi64(q.mul, 32);
    q.off_e = _mm256_loadu_si256((const __m256i *)(b->off + 4 * h));
    q.off_o = _mm256_loadu_si256((const __m256i *)(b->off + 8 + 4 * h));
    q.sh = _mm256_loadu_si256((const __m256i *)(b->sh + 8 * h));
    q.lo = _mm256_loadu_si256((const __m256i *)(b->lo + 8 * h));
    q.hi = _mm256_loadu_si256((const __m256i *)(b->hi + 8 * h));
    return q;
}

static inline __m256i rq8_apply(__m256i acc, const qir_rq8 *q) {
    const __m256i pe = _mm256_add_epi64(_mm256_mul_epi32(acc, q->mul), q->off_e);
    const __m256i po = _mm256_add_epi64(_mm256_mul_epi32(_mm256_srli_epi64(acc, 32), q->mul_o), q->off_o);
    const __m256i v = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
    return _mm256_min_epi32(_mm256_max_epi32(_mm256_srav_epi32(v, q->sh), q->lo), q->hi);
}

/* Store 8 int32 codes already inside OUT_T's range as int8 or int16. */
#define QIR_STORE8(OUT_T, dst, v)                                                                 \
    do {                                                                                          \
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); \
        if (sizeof(OUT_T) == 1)                                                                   \
            _mm_storel_epi64((__m128i *)(void *)(dst), _mm_packs_epi16(w16, w16));                \
        else                                                                                      \
            _mm_storeu_si128((__m128i *)(void *)(dst), w16);                                      \
    } while (0)
#endif

#endif
