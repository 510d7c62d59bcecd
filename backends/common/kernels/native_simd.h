/* What the native kernels' C files share (native.c, native_dw.c): the instruction-set switch, the VNNI
 * product instruction and the masked stores of 16 codes (the requantization: native_requant.h). */
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
