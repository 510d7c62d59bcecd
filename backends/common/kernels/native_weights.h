/* A conv / linear weight's conversion in one pass (native_weights.c; qir.nn.quantized.conv_weight). */
#ifndef QIR_NATIVE_WEIGHTS_H
#define QIR_NATIVE_WEIGHTS_H
#include <stdint.h>

/* Rows [r0, r1) of a contiguous float32 weight of rows of k elements (its output channels along axis 0).
 * Row r's scale s: mode 0, scale[r]; else the weight observer's update from the row's extremes lo, hi:
 * mode 1 takes them (a moving average with constant 1), mode 2 widens the range old_lo[r], old_hi[r]
 * by them (a running min / max); then s = max(max(max(-lo', hi'), 0) / den, eps), each a float32
 * operation, written to scale_out[r]. codes = clamp(floor(w / s) + (w / s - floor(w / s) >= 1/2), qmin,
 * qmax) (float32 division: numerics.quantize's half-up rounding, exact) and sums[r] = sum |codes|.
 * Returns the number of rows holding a NaN or an infinity (or, modes 1 and 2, whose update would not be
 * the plain one: a difference from the old range beyond float32); such a row's outputs are not to be used. */
int64_t qir_weight_codes_rows_i8(const float *w, int64_t k, int64_t mode, const float *scale, const float *old_lo,
                                 const float *old_hi, float den, float eps, float *scale_out, int8_t *codes,
                                 int64_t *sums, int64_t r0, int64_t r1);
int64_t qir_weight_codes_rows_i16(const float *w, int64_t k, int64_t mode, const float *scale, const float *old_lo,
                                  const float *old_hi, float den, float eps, float *scale_out, int16_t *codes,
                                  int64_t *sums, int64_t r0, int64_t r1);

#endif
