/* A conv / linear weight's conversion: the weight observer's per-channel update and scale, the codes and
 * their per-channel L1 norms, one row (output channel) at a time while it is in the cache. The torch path
 * (qir.nn.quantized.conv_weight) makes the same IEEE operations, a tensor pass each; tests compare both
 * bit for bit. The reductions are integer ones, which the compiler vectorises (float ones it may not
 * reorder): the extremes over the floats' bits mapped to integers of the same order, and whether any
 * exponent field is all ones (a NaN or an infinity). */
#include "native_weights.h"

#include <math.h>
#include <string.h>

#define EXPONENT 0x7f800000u

static inline uint32_t bits_of(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* An int32 of the same order as the finite float of bits u (-0 just below +0). */
static inline int32_t ordered(uint32_t u) {
    const int32_t i = (int32_t)u;
    return i ^ (int32_t)(((uint32_t)(i >> 31)) >> 1);
}

static inline float from_ordered(int32_t i) {
    const uint32_t u = (uint32_t)(i ^ (int32_t)(((uint32_t)(i >> 31)) >> 1));
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The row's extremes; 0 when an element is a NaN or an infinity. */
static int row_extremes(const float *restrict ws, int64_t k, float *lo_out, float *hi_out) {
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    uint32_t special = 0;
    for (int64_t i = 0; i < k; ++i) {
        const uint32_t u = bits_of(ws[i]);
        const int32_t o = ordered(u);
        lo = o < lo ? o : lo;
        hi = o > hi ? o : hi;
        special |= (u & EXPONENT) == EXPONENT;
    }
    *lo_out = from_ordered(lo);
    *hi_out = from_ordered(hi);
    return !special;
}

#define WEIGHT_CODES(NAME, OUT_T, QMIN, QMAX)                                                                    \
    int64_t NAME(const float *w, int64_t k, int64_t mode, const float *scale, const float *old_lo,               \
                 const float *old_hi, float den, float eps, float *scale_out, OUT_T *codes, int64_t *sums,       \
                 int64_t r0, int64_t r1) {                                                                       \
        int64_t bad = 0;                                                                                         \
        for (int64_t r = r0; r < r1; ++r) {                                                                      \
            const float *restrict ws = w + r * k;                                                                \
            float s;                                                                                             \
            if (mode == 0) {                                                                                     \
                s = scale[r];                                                                                    \
            } else {                                                                                             \
                float lo, hi;                                                                                    \
                if (k < 1 || !row_extremes(ws, k, &lo, &hi)) {                                                   \
                    ++bad;                                                                                       \
                    continue;                                                                                    \
                }                                                                                                \
                if (mode == 1) {                                                                                 \
                    /* lerp(old, new, 1) is new when new - old is finite (else inf * 0: NaN) */                  \
                    if (!isfinite(lo - old_lo[r]) || !isfinite(hi - old_hi[r])) {                                \
                        ++bad;                                                                                   \
                        continue;                                                                                \
                    }                                                                                            \
                } else {                                                                                         \
                    lo = old_lo[r] < lo ? old_lo[r] : lo;                                                        \
                    hi = old_hi[r] > hi ? old_hi[r] : hi;                                                        \
                }                                                                                                \
                float amax = -lo > hi ? -lo : hi;                                                                \
                amax = amax < 0.0f ? 0.0f : amax;                                                                \
                s = amax / den;                                                                                  \
                s = s < eps ? eps : s;                                                                           \
                scale_out[r] = s;                                                                                \
            }                                                                                                    \
            OUT_T *restrict os = codes + r * k;                                                                  \
            int64_t sum = 0;                                                                                     \
            uint32_t special = 0;                                                                                \
            /* int32 partial sums over blocks short enough not to overflow (|code| <= 2**15) */                \
            for (int64_t i0 = 0; i0 < k; i0 += 1 << 15) {                                                        \
                const int64_t i1 = i0 + (1 << 15) < k ? i0 + (1 << 15) : k;                                      \
                int32_t part = 0;                                                                                \
                for (int64_t i = i0; i < i1; ++i) {                                                              \
                    const float x = ws[i];                                                                       \
                    special |= (bits_of(x) & EXPONENT) == EXPONENT;                                              \
                    const float v = x / s;                                                                       \
                    const float f = floorf(v);                                                                   \
                    float q = f + (v - f >= 0.5f ? 1.0f : 0.0f);                                                 \
                    q = q < (QMIN) ? (QMIN) : (q > (QMAX) ? (QMAX) : q);                                         \
                    const int32_t c = (int32_t)q;                                                                \
                    os[i] = (OUT_T)c;                                                                            \
                    part += c < 0 ? -c : c;                                                                      \
                }                                                                                                \
                sum += part;                                                                                     \
            }                                                                                                    \
            if (special) { /* a NaN or infinite weight: the caller's torch path decides */                       \
                ++bad;                                                                                           \
                continue;                                                                                        \
            }                                                                                                    \
            sums[r] = sum;                                                                                       \
        }                                                                                                        \
        return bad;                                                                                              \
    }

WEIGHT_CODES(qir_weight_codes_rows_i8, int8_t, -128.0f, 127.0f)
WEIGHT_CODES(qir_weight_codes_rows_i16, int16_t, -32768.0f, 32767.0f)
