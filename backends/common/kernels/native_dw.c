/* The depthwise conv with four taps per int32 lane (AVX-512 VNNI vpdpbusd): 64 multiply-adds per
 * instruction where native.c's qir_dw_rows_* do 16.
 *
 * Lane k of a vector holds channel k of a block of 16; its 4 bytes are 4 horizontally adjacent taps
 * of one kernel row (columns 4g .. 4g+3 of the kernel, zero weights past kw). The input is
 * rearranged once per input row into "entries": entry p of row yi holds, for each channel k, the
 * codes of columns p - pw + t * dw (t = 0..3) xor 0x80 (vpdpbusd multiplies unsigned by signed
 * bytes: a + 128, and 0x80 = a zero code where the column is padding). Output pixel (y, xo) then
 * needs, per kernel row i and group g, one vpdpbusd of entry xo * sw + 4 g dw of input row
 * y sh - ph + i dh with the packed weights: 3 instructions for a 3x3 kernel. The accumulator starts
 * at -128 * (sum of the channel's weights), which undoes the + 128; a kernel row that falls in the
 * vertical padding is skipped and its 128 * (row sum) added back instead. int32 arithmetic wraps
 * (vpdpbusd does not saturate), so the sum is exact whenever the true sum fits int32
 * (|sum| <= kh kw 128 * 128, the caller's bound), and the requantization is native_requant.h's.
 *
 * A part of the pool's work is a range of units u = (channel group, n, oy): groups of gcb channel
 * blocks split a small layer across threads by channels, rows split a large one. Each part keeps
 * the entries of the last (kh - 1) dh + 1 input rows it built (a ring indexed by row), so a row is
 * rearranged once per part, not once per output row that reads it.
 */
#include "native_dw.h"

#include <stdlib.h>
#include <string.h>

#include "native_requant.h"
#include "native_simd.h"

#if QIR_VNNI
/* a, b, c, d: 16 codes each (columns t = 0..3 of 16 channels) -> byte 4k + t = column t's channel k. */
static inline __m512i interleave4(__m128i a, __m128i b, __m128i c, __m128i d) {
#if defined(__AVX512VBMI__)
#define Q(k) k, 16 + k, 32 + k, 48 + k
    static const uint8_t idx[64] = {Q(0), Q(1), Q(2),  Q(3),  Q(4),  Q(5),  Q(6),  Q(7),
                                    Q(8), Q(9), Q(10), Q(11), Q(12), Q(13), Q(14), Q(15)};
#undef Q
    __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(a), b, 1);
    v = _mm512_inserti64x4(v, _mm256_inserti128_si256(_mm256_castsi128_si256(c), d, 1), 1);
    return _mm512_permutexvar_epi8(_mm512_loadu_si512((const void *)idx), v);
#else
    /* without vpermb: byte then word interleaves, each 128-bit quarter 4 channels */
    const __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
    const __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(ab0, cd0)),
                                               _mm_unpackhi_epi16(ab0, cd0), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(ab1, cd1)),
                                               _mm_unpackhi_epi16(ab1, cd1), 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#endif
}

/* The entries [0, np) of one input row (xrow: its w pixels of c codes) for channel blocks
 * [cb0, cb1), block-major: dst[((cb - cb0) np + p) 64 + 4k + t] = column p es - pw + t dw, for
 * t < nt (zero weights past it: those bytes are 0x80). Reads x only at columns inside [0, w) and
 * channels below c (masked loads). */
/* Entries from p on while all nt (a constant) columns lie inside the row: no test per column. */
#define QIR_INTERIOR(NT)                                                                                   \
    for (const int8_t *src = xc + (p * es - pw) * c; p < np && p * es - pw + ((NT)-1) * dw < w;           \
         ++p, dst += 64, src += es * c) {                                                                  \
        const __m128i z = _mm_setzero_si128();                                                            \
        const __m128i a = _mm_maskz_loadu_epi8(m, src);                                                    \
        const __m128i b = (NT) > 1 ? _mm_maskz_loadu_epi8(m, src + dw * c) : z;                            \
        const __m128i d = (NT) > 2 ? _mm_maskz_loadu_epi8(m, src + 2 * dw * c) : z;                        \
        const __m128i e = (NT) > 3 ? _mm_maskz_loadu_epi8(m, src + 3 * dw * c) : z;                        \
        _mm512_storeu_si512((void *)dst, _mm512_xor_si512(interleave4(a, b, d, e), flip));                 \
    }

static void build_row(const int8_t *restrict xrow, int64_t w, int64_t c, int64_t pw, int64_t dw, int64_t np,
                      int64_t es, int nt, int64_t cb0, int64_t cb1, int8_t *restrict dst) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t cb = cb0; cb < cb1; ++cb) {
        const __mmask16 m = lanes16(c - cb * 16);
        const int8_t *xc = xrow + cb * 16;
        int64_t p = 0;
        for (int pass = 0; pass < 2; ++pass) {
            /* the entries that reach into the padding (left edge, then right edge), column by column */
            for (; p < np && (pass || p * es - pw < 0); ++p, dst += 64) {
                __m128i v[4];
                for (int t = 0; t < 4; ++t) {
                    const int64_t xi = p * es - pw + t * dw;
                    v[t] = t < nt && xi >= 0 && xi < w ? _mm_maskz_loadu_epi8(m, xc + xi * c) : _mm_setzero_si128();
                }
                _mm512_storeu_si512((void *)dst, _mm512_xor_si512(interleave4(v[0], v[1], v[2], v[3]), flip));
            }
            if (pass) break;
            switch (nt) {
                case 1: QIR_INTERIOR(1) break;
                case 2: QIR_INTERIOR(2) break;
                case 3: QIR_INTERIOR(3) break;
                default: QIR_INTERIOR(4) break;
            }
        }
    }
}
#undef QIR_INTERIOR

#define DW_VNNI(NAME, OUT_T)                                                                                      \
    int NAME(const int8_t *restrict x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh,       \
             int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow,                   \
             const int8_t *restrict wpk, const int32_t *restrict comp, int64_t nrows, int64_t gcb,                \
             const qir_rqblock *restrict rq, int64_t fast, OUT_T *restrict out,                                   \
             int64_t u0, int64_t u1) {                                                                            \
        const int64_t ncb = (c + 15) / 16, cpad = ncb * 16, g4 = (kw + 3) / 4;                                   \
        /* one group of 4 columns: an entry per output column (es = sw); more: an entry per input column */   \
        const int64_t es = g4 == 1 ? sw : 1, np = g4 == 1 ? ow : (ow - 1) * sw + 4 * (g4 - 1) * dw + 1;          \
        const int nt = g4 == 1 ? (int)kw : 4;                                                                     \
        const int64_t slots = (kh - 1) * dh + 1;                                                                  \
        const int64_t slot_bytes = gcb * np * 64;                                                                 \
        int8_t *ring = (int8_t *)malloc((size_t)(slots * slot_bytes));                                            \
        int64_t *tags = (int64_t *)malloc(sizeof(int64_t) * (size_t)slots);                                       \
        const int8_t **rowp = (const int8_t **)malloc(sizeof(int8_t *) * (size_t)kh);                              \
        int64_t *rowi = (int64_t *)malloc(sizeof(int64_t) * (size_t)kh);                                          \
        if (!ring || !tags || !rowp || !rowi) {                                                                   \
            free(ring), free(tags), free(rowp), free(rowi);                                                       \
            return 1;                                                                                             \
        }                                                                                                         \
        for (int64_t s = 0; s < slots; ++s) tags[s] = -1;                                                         \
        for (int64_t u = u0; u < u1; ++u) {                                                                       \
            const int64_t grp = u / nrows, r = u % nrows, b = r / oh, y = r % oh;                                 \
            const int64_t cb0 = grp * gcb, cb1 = cb0 + gcb < ncb ? cb0 + gcb : ncb;                               \
            int64_t nv = 0; /* the kernel rows inside the image: their entries in the ring */                    \
            for (int64_t i = 0; i < kh; ++i) {                                                                    \
                const int64_t yi = y * sh - ph + i * dh;                                                          \
                if (yi < 0 || yi >= h) continue;                                                                  \
                const int64_t s = yi % slots, tag = grp * nrows * h + b * h + yi;                                 \
                int8_t *e = ring + s * slot_bytes;                                                                \
                if (tags[s] != tag) {                                                                             \
                    build_row(x + (b * h + yi) * w * c, w, c, pw, dw, np, es, nt, cb0, cb1, e);                           \
                    tags[s] = tag;                                                                                \
                }                                                                                                 \
                rowp[nv] = e, rowi[nv++] = i;                                                                     \
            }                                                                                                     \
            for (int64_t cb = cb0; cb < cb1; ++cb) {                                                              \
                const int64_t ch = cb * 16;                                                                       \
                const __mmask16 m = lanes16(c - ch);                                                              \
                const qir_rqv q = rqv_load(rq + cb);                                                              \
                /* -128 * (all weights) + 128 * (the weights of the rows left out) */                           \
                __m512i init = _mm512_loadu_si512((const void *)(comp + kh * cpad + ch));                         \
                for (int64_t i = 0, v = 0; i < kh; ++i) {                                                         \
                    if (v < nv && rowi[v] == i) {                                                                 \
                        ++v;                                                                                      \
                        continue;                                                                                 \
                    }                                                                                             \
                    init = _mm512_add_epi32(init, _mm512_loadu_si512((const void *)(comp + i * cpad + ch)));     \
                }                                                                                                 \
                const int8_t *wcb = wpk + cb * kh * g4 * 64;                                                      \
                const int64_t eoff = (cb - cb0) * np * 64;                                                        \
                OUT_T *o = out + r * ow * c + ch;                                                                 \
                int64_t xo = 0;                                                                                   \
                if (g4 == 1 && nv <= 3) {                                                                         \
                    /* kernels up to 3 rows and 4 columns (3x3): weights and row pointers in registers (the       \
                     * general loop below reloads them per pixel, out may alias them); rows missing at the      \
                     * image's edge take zero weights on a row that is there */                                  \
                    const __m512i z = _mm512_setzero_si512();                                                     \
                    const __m512i w0 = nv > 0 ? _mm512_loadu_si512((const void *)(wcb + rowi[0] * 64)) : z;       \
                    const __m512i w1 = nv > 1 ? _mm512_loadu_si512((const void *)(wcb + rowi[1] * 64)) : z;       \
                    const __m512i w2 = nv > 2 ? _mm512_loadu_si512((const void *)(wcb + rowi[2] * 64)) : z;       \
                    const int8_t *e0 = nv > 0 ? rowp[0] + eoff : NULL;                                           \
                    const int8_t *e1 = nv > 1 ? rowp[1] + eoff : e0, *e2 = nv > 2 ? rowp[2] + eoff : e0;         \
                    for (; e0 && xo < ow; ++xo, o += c) {                                                         \
                        __m512i acc = init;                                                                       \
                        QIR_DPBUSD(acc, _mm512_loadu_si512((const void *)(e0 + xo * 64)), w0);                    \
                        QIR_DPBUSD(acc, _mm512_loadu_si512((const void *)(e1 + xo * 64)), w1);                    \
                        QIR_DPBUSD(acc, _mm512_loadu_si512((const void *)(e2 + xo * 64)), w2);                    \
                        QIR_STORE16(OUT_T, o, m, rqv_apply(acc, &q, fast));                                       \
                    }                                                                                             \
                }                                                                                                 \
                for (; xo < ow; ++xo, o += c) {                                                                   \
                    __m512i acc = init;                                                                           \
                    for (int64_t v = 0; v < nv; ++v) {                                                            \
                        const int8_t *e = rowp[v] + eoff + xo * (sw / es) * 64;                                   \
                        const int8_t *wk = wcb + rowi[v] * g4 * 64;                                               \
                        for (int64_t g = 0; g < g4; ++g)                                                          \
                            QIR_DPBUSD(acc, _mm512_loadu_si512((const void *)(e + 4 * g * dw * 64)),              \
                                       _mm512_loadu_si512((const void *)(wk + g * 64)));                          \
                    }                                                                                             \
                    QIR_STORE16(OUT_T, o, m, rqv_apply(acc, &q, fast));                                           \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        free(ring), free(tags), free(rowp), free(rowi);                                                           \
        return 0;                                                                                                 \
    }
DW_VNNI(qir_dw_vnni_i8, int8_t)
DW_VNNI(qir_dw_vnni_i16, int16_t)
#else
#define DW_VNNI_ABSENT(NAME, OUT_T)                                                                               \
    int NAME(const int8_t *x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,    \
             int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow, const int8_t *wpk,            \
             const int32_t *comp, int64_t nrows, int64_t gcb, const qir_rqblock *rq, int64_t fast, OUT_T *out,    \
             int64_t u0, int64_t u1) {                                                                            \
        (void)x, (void)h, (void)w, (void)c, (void)kh, (void)kw, (void)sh, (void)sw, (void)ph, (void)pw, (void)dh; \
        (void)dw, (void)oh, (void)ow, (void)wpk, (void)comp, (void)nrows, (void)gcb, (void)rq, (void)fast;        \
        (void)out, (void)u0, (void)u1;                                                                            \
        return 1;                                                                                                 \
    }
DW_VNNI_ABSENT(qir_dw_vnni_i8, int8_t)
DW_VNNI_ABSENT(qir_dw_vnni_i16, int16_t)
#endif
