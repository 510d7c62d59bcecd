/* The four-taps-per-lane depthwise conv (native_dw.c). */
#ifndef QIR_NATIVE_DW_H
#define QIR_NATIVE_DW_H
#include <stdint.h>

#include "native_requant.h"

/* Depthwise conv + requantization on int8 NHWC x (n images of h x w x c) over units [u0, u1) of
 * (channel group, image, output row) = u / nrows, (u % nrows) / oh, u % oh with nrows = n oh and
 * groups of gcb blocks of 16 channels. wpk: native.py's pack_dw weights, ceil(c / 16) blocks of
 * (kh, ceil(kw / 4), 16 channels, 4 taps) bytes; comp: (kh + 1, 16 ceil(c / 16)) int32, rows
 * i < kh = 128 * (the sum of kernel row i's weights), row kh = -128 * (the sum of all); rq, fast:
 * ceil(c / 16) blocks of the requantization's parameters and their mode (native_requant.h). Writes
 * out[(n, oy, ox, channel)] of the units' rows and channels only. Returns 1 without the AVX-512 VNNI
 * build or out of memory, else 0. */
int qir_dw_vnni_i8(const int8_t *x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                   int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow, const int8_t *wpk,
                   const int32_t *comp, int64_t nrows, int64_t gcb, const qir_rqblock *rq, int64_t fast, int8_t *out,
                   int64_t u0, int64_t u1);
int qir_dw_vnni_i16(const int8_t *x, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                    int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh, int64_t ow, const int8_t *wpk,
                    const int32_t *comp, int64_t nrows, int64_t gcb, const qir_rqblock *rq, int64_t fast, int16_t *out,
                    int64_t u0, int64_t u1);

#endif
