/* Advances torch's CPU random generator past n outputs without computing them.
 *
 * torch's CPU generator is an mt19937 (ATen/core/MT19937RNGEngine.h): each output decrements
 * `left`, regenerates the 624 state words when it reaches 0 (the "twist", which resets left to 624
 * and next to 0), and returns the tempered word state[next++]. The tempering and the conversion to
 * a float change nothing in the state, so skipping n outputs is the twists alone: one per 624
 * outputs, about a fortieth of the work of drawing them, and no memory written but the state.
 * random_skip.py reads the state from Generator.get_state(), calls this and writes it back; it
 * checks the result against a real draw before the first use. */
#include <stdint.h>

#define MT_N 624
#define MT_M 397

static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    /* MT19937RNGEngine.h's twist: mix the high bit of u with the low bits of v, shift, and add the
     * matrix when v is odd (branch-free, so the loops below vectorise) */
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

/* MT19937RNGEngine.h's next_state, in three loops of the same updates in the same order */
static void mt_next_state(uint32_t *s) {
    int j = 0;
    for (; j < MT_N - MT_M; ++j) s[j] = s[j + MT_M] ^ mt_twist(s[j], s[j + 1]);
    for (; j < MT_N - 1; ++j) s[j] = s[j + MT_M - MT_N] ^ mt_twist(s[j], s[j + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ mt_twist(s[MT_N - 1], s[0]);
}

/* Skip n outputs of the generator whose state is: words (624 state words, each in a uint64 as
 * get_state() lays them out), *left, *next. Returns 0, or -1 (nothing changed) for a state the
 * engine would refuse (left outside [1, 624], next past 624) or a negative n. */
int qir_mt19937_skip(uint64_t *words, int32_t *left, uint64_t *next, int64_t n) {
    int64_t l = *left;
    uint64_t nx = *next;
    if (l < 1 || l > MT_N || nx > MT_N || n < 0) return -1;
    if (n < l) { /* no output reaches left == 0 */
        *left = (int32_t)(l - n);
        *next = nx + (uint64_t)n;
        return 0;
    }
    /* the first l - 1 outputs come from the current words; every later one starts a block of at
     * most 624 after a twist: k outputs of a block leave left = 625 - k, next = k */
    n -= l - 1;
    uint32_t s[MT_N];
    for (int i = 0; i < MT_N; ++i) s[i] = (uint32_t)words[i];
    int64_t k = 0;
    while (n > 0) {
        mt_next_state(s);
        k = n < MT_N ? n : MT_N;
        n -= k;
    }
    for (int i = 0; i < MT_N; ++i) words[i] = s[i];
    *left = (int32_t)(MT_N + 1 - k);
    *next = (uint64_t)k;
    return 0;
}
