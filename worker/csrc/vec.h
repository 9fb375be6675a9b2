/* Vectors of the build's width and the few operations on them that both attention kernels use. */
#ifndef KVS_VEC_H
#define KVS_VEC_H
#include <stdint.h>
#include <string.h>

/* Vectors of VW floats, the width of the build's registers: 16 with AVX-512, else 8 (AVX2). A 16-lane
 * type on AVX2 takes two registers each, and the kernel's queries and accumulators then spilled to
 * memory: it read K/V at 6 GB/s where the 8-lane build reads at the host's bandwidth. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
#define UNROLL _Pragma("GCC unroll 16")

static inline __attribute__((always_inline)) vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if VW == 16
static const vi lane_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const vi lane_ids = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

static inline __attribute__((always_inline)) vf selectv(vi mask, vf a, vf b) {
    vi r = (mask & (vi)a) | (~mask & (vi)b);
    return (vf)r;
}

static inline __attribute__((always_inline)) vf vmaxv(vf a, vf b) {
    return selectv(a > b, a, b);
}

/* e^x for x <= 0 (softmax arguments), to about 2e-7 relative: 2^(x log2 e) split into an integer
 * power, put straight into the exponent bits, and 2^f for |f| <= 1/2 by its Taylor series. Inputs
 * below -87 give e^-87 (about 1.6e-38), which is as good as zero next to the block maximum's 1. */
static inline __attribute__((always_inline)) vf expv(vf x) {
    const vf lo = (vf){0} - 87.0f;
    x = vmaxv(x, lo);
    vf t = x * 1.44269504f;
    vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 pushes the fraction out */
    vf f = t - n;
    vf p = 1.3333558e-3f + f * 1.5403530e-4f;
    p = 9.6181291e-3f + f * p;
    p = 5.5504109e-2f + f * p;
    p = 2.4022651e-1f + f * p;
    p = 6.9314718e-1f + f * p;
    p = 1.0f + f * p;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

#endif
