/* What the native kernels' C files share (native.c, native_dw.c): the instruction-set switch and the
 * vector requantization of 16 int32 accumulators. */
#ifndef QIR_NATIVE_SIMD_H
#define QIR_NATIVE_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QIR_VNNI 1
#else
#define QIR_VNNI 0
#endif

#if QIR_VNNI
/* native.c's REQUANT_ROWS (clamp(floor(acc * scale + offset), lo, hi), exact under the bound stated
 * there) on 16 int32 lanes, the first of them selected by m (per-channel arrays read only there):
 * one fused multiply-add, floor and clamp per lane in double, the IEEE operations of the scalar
 * loop, so the same codes; one masked pass per 16 channels instead of a scalar tail. */
typedef struct {
    __m512d s0, s1, o0, o1, l0, l1, h0, h1; /* scale, offset, lo, hi of lanes 0-7 and 8-15 */
} qir_rq16;

static inline qir_rq16 rq16_load(const double *scale, const double *offset, const double *lo, const double *hi,
                                 __mmask16 m) {
    const __mmask8 m0 = (__mmask8)m, m1 = (__mmask8)(m >> 8);
    qir_rq16 q;
    q.s0 = _mm512_maskz_loadu_pd(m0, scale), q.s1 = _mm512_maskz_loadu_pd(m1, scale + 8);
    q.o0 = _mm512_maskz_loadu_pd(m0, offset), q.o1 = _mm512_maskz_loadu_pd(m1, offset + 8);
    q.l0 = _mm512_maskz_loadu_pd(m0, lo), q.l1 = _mm512_maskz_loadu_pd(m1, lo + 8);
    q.h0 = _mm512_maskz_loadu_pd(m0, hi), q.h1 = _mm512_maskz_loadu_pd(m1, hi + 8);
    return q;
}

/* The requantization with its parameters already in registers (a loop over pixels loads them once). */
static inline __m512i rq16_apply(__m512i acc, const qir_rq16 *q) {
    const int rnd = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
    __m512d v0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(acc));
    __m512d v1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc, 1));
    v0 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_fmadd_pd(v0, q->s0, q->o0), rnd), q->l0), q->h0);
    v1 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_fmadd_pd(v1, q->s1, q->o1), rnd), q->l1), q->h1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epi32(v0)), _mm512_cvttpd_epi32(v1), 1);
}

static inline __m512i requant16(__m512i acc, const double *scale, const double *offset, const double *lo,
                                const double *hi, __mmask16 m) {
    const qir_rq16 q = rq16_load(scale, offset, lo, hi, m);
    return rq16_apply(acc, &q);
}

/* acc += a (unsigned bytes) . b (signed bytes), four per int32 lane. Inline asm rather than
 * _mm512_dpbusd_epi32: gcc 12 copies the intrinsic's accumulator through a spare register on every
 * call and then spills the 24 accumulators of a tile to the stack (three times slower). */
#define QIR_DPBUSD(acc, ua, sb) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(ua), "vm"(sb))

/* Store the first lanes (mask m) of 16 codes already inside OUT_T's range (int8 or int16). */
#define QIR_STORE16(OUT_T, dst, m, v)                                       \
    do {                                                                    \
        if (sizeof(OUT_T) == 1)                                             \
            _mm512_mask_cvtepi32_storeu_epi8((void *)(dst), (m), (v));      \
        else                                                                \
            _mm512_mask_cvtepi32_storeu_epi16((void *)(dst), (m), (v));     \
    } while (0)

static inline __mmask16 lanes16(int64_t k) { return k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << k) - 1); }
#endif

#endif
