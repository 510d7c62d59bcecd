/* Kernels of QAT training on the integer grid: the float tensors hold integer codes and the
 * requantization is evaluated exactly in float64 (qir.quantization.integer_grid_conv, whose torch
 * path makes the same IEEE operations one tensor pass each; tests compare both bit for bit).
 * One pass over memory per call instead of seven or eight, and one parallel region. */
#include "native_grid.h"

#include <math.h>
#include <stdint.h>

void qir_grid_requant_rows(const float *acc, int64_t hw, int64_t c, const double *ratio, const double *offset,
                           const float *acc_grad, int64_t lo, int64_t hi, float out_scale, float *out, float *gain,
                           int64_t r0, int64_t r1) {
    const float flo = (float)lo, fhi = (float)hi;
    /* torch's hardtanh_backward against lo - 1/2, hi + 1/2 (exact in float32 for int16 bounds) */
    const float glo = flo - 0.5f, ghi = fhi + 0.5f;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t ch = r % c;
        const double k = ratio[ch], b = offset[ch];
        const float g = acc_grad[ch];
        const float *a = acc + r * hw;
        float *o = out + r * hw;
        float *restrict gn = gain + r * hw;
        for (int64_t i = 0; i < hw; ++i) {
            double q = (double)a[i] * k;
            q = q + b;
            const float v = (float)floor(q);
            gn[i] = (v <= glo || v >= ghi) ? 0.0f : g; /* a NaN keeps its gradient, as in torch */
            const float cv = v < flo ? flo : (v > fhi ? fhi : v); /* NaN stays NaN, as torch's clamp */
            o[i] = cv * out_scale;
        }
    }
}

void qir_grid_codes_rows(const float *x, int64_t n, int64_t len, float inv, float *out, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i0 = r * len, i1 = i0 + len < n ? i0 + len : n;
        const float *restrict xs = x + i0;
        float *restrict os = out + i0;
        for (int64_t i = 0; i < i1 - i0; ++i) os[i] = nearbyintf(xs[i] * inv);
    }
}

void qir_grid_weight_codes_rows(const float *w, int64_t k, int64_t c, const float *scale, const float *fac,
                                int64_t qmin, int64_t qmax, float *out, float *factor, int64_t r0, int64_t r1) {
    const float lo = (float)qmin, hi = (float)qmax;
    for (int64_t r = r0; r < r1; ++r) {
        const float s = scale[r % c], g = fac[r % c];
        const float *restrict ws = w + r * k;
        float *restrict os = out + r * k;
        float *restrict fs = factor + r * k;
        for (int64_t i = 0; i < k; ++i) {
            const float v = ws[i] / s;
            const float f = floorf(v);
            /* numerics.round_half_up: f + (v - f >= 0.5) as 1 or 0 (adding 0 makes a floored -0 into +0) */
            const float q = f + (v - f >= 0.5f ? 1.0f : 0.0f);
            const float qc = q < lo ? lo : (q > hi ? hi : q);
            os[i] = qc;
            fs[i] = qc == q ? g : 0.0f;
        }
    }
}

void qir_grid_fused_add_rows(const float *acc, const float *addend, int64_t hw, int64_t c, const float *acc_lo,
                             const float *acc_hi, const double *r1, const double *off1, const double *r2, float inv_add,
                             int64_t extra_bits, int64_t lo, int64_t hi, float out_scale, float *out, float *keep,
                             int64_t r0, int64_t r1_) {
    const float flo = (float)lo, fhi = (float)hi;
    const float glo = flo - 0.5f, ghi = fhi + 0.5f;
    const double k2 = *r2, post = ldexp(1.0, -(int)extra_bits); /* times 2**-p: exact, as torch's mul_ by it */
    for (int64_t r = r0; r < r1_; ++r) {
        const int64_t ch = r % c;
        const float alo = acc_lo[ch], ahi = acc_hi[ch];
        const double k1 = r1[ch], b1 = off1[ch];
        const float *a = acc + r * hw;
        const float *d = addend + r * hw;
        float *o = out + r * hw;
        float *restrict kp = keep + r * hw;
        for (int64_t i = 0; i < hw; ++i) {
            float x = a[i];
            x = x < alo ? alo : x; /* torch's clamp by tensors: a NaN stays NaN */
            x = x > ahi ? ahi : x;
            double s = (double)x * k1;
            s = s + b1;
            s = floor(s); /* mid1 */
            double m2 = (double)nearbyintf(d[i] * inv_add) * k2;
            m2 = m2 + 0.5;
            s = s + floor(m2); /* + mid2 */
            s = s * post;
            s = s + 0.5;
            const float v = (float)floor(s);
            kp[i] = (v <= glo || v >= ghi) ? 0.0f : 1.0f;
            const float cv = v < flo ? flo : (v > fhi ? fhi : v);
            o[i] = cv * out_scale;
        }
    }
}

int64_t qir_grid_abs_row_max(const float *q, int64_t k, int64_t r0, int64_t r1) {
    int64_t top = 0;
    int nan = 0;
    for (int64_t r = r0; r < r1; ++r) {
        const float *restrict qs = q + r * k;
        int64_t sum = 0;
        /* branch-free, so it vectorizes: |q| < 2**24 converts exactly; a NaN counts 0 and sets the flag */
        for (int64_t i = 0; i < k; ++i) {
            const float v = qs[i];
            const float a = v < 0.0f ? -v : v;
            nan |= v != v;
            sum += (int32_t)(v == v ? a : 0.0f);
        }
        if (sum > top) top = sum;
    }
    return nan ? INT64_MAX : top; /* NaN: the caller's torch path decides */
}
