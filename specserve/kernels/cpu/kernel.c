/* Few-row float32 forward of a Llama-family decoder on the CPU (see binding.py).
 *
 * A decode or verify step feeds a handful of rows, so every weight matrix is read once from
 * memory and each row's products run from cache: the step costs about the weight bytes over
 * the memory bandwidth, plus one call from Python per layer instead of some twenty operator
 * launches. Every output element is computed by the same code in the same order whatever the
 * other rows are, so a row's result does not depend on how many rows share the step (a
 * one-token decode and a five-token verify agree bit for bit).
 *
 * Built by binding.py with: cc -O3 -march=native -ffp-contract=off -fopenmp -shared -fPIC.
 * Without -ffp-contract=off GCC fuses a multiply into a later add where it sees fit: built
 * for AVX2 it fused a score's products differently for 7 or 8 queries than for fewer, and a
 * verify row's attention came out one unit in the last place off the decode's. So nothing is
 * fused but what fma_v / fma_s say, wherever the code stands.
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

/* Vector width by instruction set: a v16 on a 256-bit machine spills registers and ran at a
 * tenth of the speed. ACC: accumulators a linear tile keeps (GROUP per row it runs at once).
 * With AVX2, 20 (five rows: a K=4 verify step in one pass) is more than its 16 registers
 * hold, yet on an AMD EPYC (Zen 3) a 5-row product ran faster than in passes of 4 + 1 rows
 * or 2 + 2 + 1: a pass widens every weight again (the products, not the bytes, bound a
 * few-row step there). */
#if defined(__AVX512F__)
#define VL 16
#define ACC 24
#elif defined(__AVX2__)
#define VL 8
#define ACC 20
#else                           /* vectors the compiler emulates: two rows, not measured wider */
#define VL 8
#define ACC 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);       /* an unaligned vector load */
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* a * b + c, fused (one rounding) where the CPU has FMA; fma_s is fma_v's lane, so a scalar
 * tail sums as the vector loop it continues */
static inline vf fma_v(vf a, vf b, vf c) {
#if VL == 16
    return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}

static inline float fma_s(float a, float b, float c) {
#if defined(__FMA__) || VL == 16
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* f in every lane: a broadcast where there are vector registers (GCC keeps `(vf){0} + f` as a
 * scalar add before its broadcast, as it turns -0 into +0: an instruction more for every input
 * and row of a product, which slowed few-row products on AVX2) */
static inline vf splat(float f) {
#if VL == 16
    return (vf)_mm512_set1_ps(f);
#elif defined(__AVX2__)
    return (vf)_mm256_set1_ps(f);
#else
    return (vf){0} + f;
#endif
}

/* VL bfloat16 values widened to floats (exactly) */
static inline vf widen_bf16(const uint16_t *p) {
    vf v;
#if VL == 16
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)),
                                        16);
    memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)),
                                        16);
    memcpy(&v, &w, sizeof v);
#else
    for (int j = 0; j < VL; j++) {
        const uint32_t u = (uint32_t)p[j] << 16;
        memcpy(&v[j], &u, 4);
    }
#endif
    return v;
}

/* KV cache elements (float32, or bfloat16 where the cache holds them so: `bf16`) from element
 * i of `base`: VL of them as floats, or one. */
static inline vf load_kv(const void *base, int64_t i, int bf16) {
    return bf16 ? widen_bf16((const uint16_t *)base + i) : loadv((const float *)base + i);
}

static inline float kv_at(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float hsum(vf s) {
    float b[VL];
    memcpy(b, &s, sizeof b);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) b[j] += b[j + w];
    return b[0];
}

/* exp of VL floats (relative error about 2e-7): exp(x) = 2^n * exp(r), x = n ln2 + r, |r| <=
 * ln2 / 2, exp(r) by its degree-6 Taylor polynomial. glibc's scalar expf is not vectorised
 * without -ffast-math and costs as much as the rest of a long-context attention. */
static inline vf expv(vf x) {
    const vf lo = x - x - 87.f, hi = x - x + 88.f;
    vi below = x < lo, above = x > hi;
    x = (vf)(((vi)x & ~below) | ((vi)lo & below));
    x = (vf)(((vi)x & ~above) | ((vi)hi & above));
    const float magic = 12582912.f;                      /* 1.5 * 2^23: rounds to an integer */
    vf n = fma_v(x, splat(1.44269504f), splat(magic)) - magic;
    /* r = x - n ln 2, ln 2 in two parts */
    vf r = fma_v(n, splat(-1.42860677e-6f), fma_v(n, splat(-0.693145752f), x));
    vf p = splat(1.f / 720);
    p = fma_v(p, r, splat(1.f / 120));
    p = fma_v(p, r, splat(1.f / 24));
    p = fma_v(p, r, splat(1.f / 6));
    p = fma_v(p, r, splat(0.5f));
    p = fma_v(p, r, splat(1.f));
    p = fma_v(p, r, splat(1.f));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

/* y[i] = exp(x[i]) for n floats, every element through expv (so an element's value never
 * depends on where it falls in the array) */
static void exp_array(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) storev(y + i, expv(loadv(x + i)));
    if (i < n) {
        float buf[VL] = {0};
        memcpy(buf, x + i, (n - i) * sizeof(float));
        storev(buf, expv(loadv(buf)));
        memcpy(y + i, buf, (n - i) * sizeof(float));
    }
}

/* sum_i a[i] * b[i] in a fixed order */
static float dot(const float *a, const float *b, int64_t n) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 4 * VL <= n; i += 4 * VL) {
        s0 = fma_v(loadv(a + i), loadv(b + i), s0);
        s1 = fma_v(loadv(a + i + VL), loadv(b + i + VL), s1);
        s2 = fma_v(loadv(a + i + 2 * VL), loadv(b + i + 2 * VL), s2);
        s3 = fma_v(loadv(a + i + 3 * VL), loadv(b + i + 3 * VL), s3);
    }
    for (; i + VL <= n; i += VL) s0 = fma_v(loadv(a + i), loadv(b + i), s0);
    float r = hsum((s0 + s1) + (s2 + s3));
    for (; i < n; i++) r = fma_s(a[i], b[i], r);
    return r;
}

/* Weight modes (the packed layout and what the products take; binding.pack_weight):
 * F32: float32 weights, float32 inputs; BF16: weights that bfloat16 holds exactly (checkpoints
 * stored in bfloat16), streamed in bfloat16: half the bytes, the same products; PAIRS:
 * bfloat16 weights and inputs (the inputs rounded to nearest even), accumulated in float32:
 * on CPUs with AVX512-BF16 one instruction takes 32 products, and no weight needs widening
 * first. BF16 and PAIRS interleave consecutive inputs in pairs: one 32-bit lane holds a
 * column's weights for inputs 2i and 2i + 1, widened to float32 by a shift and a mask. I8:
 * symmetric int8 weights (quantization="int8") with one float32 scale per output column, and
 * inputs quantized on the fly to int8 with one scale per QB of them (as llama.cpp's Q8_0
 * does): the products are integer dot products of four byte pairs per 32-bit lane
 * (AVX512-VNNI: 64 in one instruction), each block's sum scaled into a float32 sum over the
 * blocks in order, and that by the column's scale at the end. A quarter of F32's bytes stream;
 * widening every weight to float32 instead cost enough instructions per byte that a one-row
 * step fell well short of the memory bandwidth, and ran 1.6x slower whenever the VM's other
 * load took a share of the core.
 * Q4, Q8: llama.cpp's Q4_0 / Q4_1 and Q8_0 blocks (quantization="q4_0", "q4_1", "q8_0"):
 * per QB inputs of a column a float16 scale and offset, the inputs quantized as for I8;
 * the bytes of a GGUF's blocks (see tile_q). */
enum { F32, BF16, PAIRS, I8, Q4, Q8 };
#define GROUP 4                 /* blocks a packed weight keeps input by input together */
#define QB 32                   /* I8: inputs per activation scale */
/* How far ahead a tile asks for its weights: the hardware prefetcher alone left the weight
 * stream short of the memory bandwidth, for an I8 tile of a few rows (its products take long)
 * and, on an AMD EPYC (Zen 3), for bfloat16 and float32 tiles too. */
#define PREFETCH 8192
#define CHUNK 6                 /* I8: rows whose integer sums a tile keeps in registers */
#if defined(__AVX2__) && VL == 8
#define I8_AVX2 1               /* tile_i8's AVX2 products take signed weights: no offset */
#define I8_OFFSET 0
#else
#define I8_AVX2 0
#define I8_OFFSET 128           /* the unsigned weights' offset, taken back from each sum */
#endif
#define ROWS (ACC / GROUP)      /* rows a tile runs at once, GROUP accumulators each */
/* Byte tiles (I8, Q4, Q8) of more rows than this stream without asking ahead: with AVX-512
 * VNNI products on an AMD EPYC (Zen 4) the prefetches slowed tiles of 3-8 rows by 15-25% (its
 * hardware prefetcher keeps up there) and left one or two rows as they were; slower products
 * (AVX2's) keep them for every row count (see PREFETCH). */
#if defined(__AVX512VNNI__) && VL == 16
#define PREFETCH_ROWS_BYTES 2
#else
#define PREFETCH_ROWS_BYTES ROWS
#endif

/* Ask for the `bytes` of weights PREFETCH past p, a cache line at a time. */
static inline void prefetch_ahead(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + PREFETCH + o);
}

/* Weights are packed as [ceil(out / (GROUP VL))][in][GROUP][VL] (F32) or
 * [..][in / 2][GROUP][VL][2] (BF16, PAIRS; `in` rounded up to even): groups of GROUP blocks of VL
 * output columns (specserve_block()), input by input, so that a tile of a whole group reads
 * one contiguous stream (on one thread, a one-row pass over the bundled target's weights took
 * a fifth less time than with each block's inputs contiguous: four streams). A tile of a
 * group (wp: its first block) times tb <= ROWS rows keeps its tb * GROUP accumulators in
 * registers while the weights stream past once; each output is summed over i in order, the
 * same for every tb. For PAIRS `in` counts pairs, and x holds each row's pairs as bfloat16
 * pairs (uint32) with AVX512-BF16, else as two floats rounded to bfloat16 (PAIRS_FLOATS). I8
 * runs in tile_i8. */
static inline __attribute__((always_inline)) void tile(const void *wp, int mode, const void *xp,
                                                       int64_t in, int tb, float *y) {
#if defined(__AVX512BF16__) && VL == 16
    if (mode == PAIRS) {
        const uint32_t *x = xp;
        __m512 acc[ROWS][GROUP];
        for (int t = 0; t < tb; t++)
            for (int b = 0; b < GROUP; b++) acc[t][b] = _mm512_setzero_ps();
        for (int64_t i = 0; i < in; i++) {
            prefetch_ahead((const uint32_t *)wp + i * GROUP * VL, GROUP * VL * 4);
            __m512bh w[GROUP];
            for (int b = 0; b < GROUP; b++)
                w[b] = (__m512bh)_mm512_loadu_si512((const uint32_t *)wp + (i * GROUP + b) * VL);
            for (int t = 0; t < tb; t++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[t * in + i]);
                for (int b = 0; b < GROUP; b++) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], w[b], xv);
            }
        }
        for (int t = 0; t < tb; t++)
            for (int b = 0; b < GROUP; b++) _mm512_storeu_ps(y + (t * GROUP + b) * VL, acc[t][b]);
        return;
    }
#endif
    vf acc[ROWS][GROUP];
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++) acc[t][b] = (vf){0};
    if (mode == PAIRS) {        /* no AVX512-BF16: widen; the odd input first, as it does */
        const float *x = xp;
        for (int64_t i = 0; i < in; i++) {
            prefetch_ahead((const uint32_t *)wp + i * GROUP * VL, GROUP * VL * 4);
            vf lo[GROUP], hi[GROUP];
            for (int b = 0; b < GROUP; b++) {
                vi w;
                memcpy(&w, (const uint32_t *)wp + (i * GROUP + b) * VL, sizeof w);
                lo[b] = (vf)(w << 16);
                hi[b] = (vf)(w & (int32_t)0xffff0000u);
            }
            for (int t = 0; t < tb; t++) {
                const vf xlo = splat(x[2 * (t * in + i)]), xhi = splat(x[2 * (t * in + i) + 1]);
                for (int b = 0; b < GROUP; b++) {
                    acc[t][b] = fma_v(hi[b], xhi, acc[t][b]);
                    acc[t][b] = fma_v(lo[b], xlo, acc[t][b]);
                }
            }
        }
    } else if (mode == BF16) {  /* each output sums its products in input order, as F32 */
        const float *x = xp;
        const int64_t full = in / 2;
        for (int64_t i = 0; i < full; i++) {
            prefetch_ahead((const uint32_t *)wp + i * GROUP * VL, GROUP * VL * 4);
            for (int b = 0; b < GROUP; b++) {
                vi w;
                memcpy(&w, (const uint32_t *)wp + (i * GROUP + b) * VL, sizeof w);
                const vf lo = (vf)(w << 16), hi = (vf)(w & (int32_t)0xffff0000u);
                for (int t = 0; t < tb; t++) {
                    acc[t][b] = fma_v(lo, splat(x[t * in + 2 * i]), acc[t][b]);
                    acc[t][b] = fma_v(hi, splat(x[t * in + 2 * i + 1]), acc[t][b]);
                }
            }
        }
        if (in % 2)             /* the last input, without a partner */
            for (int b = 0; b < GROUP; b++) {
                vi w;
                memcpy(&w, (const uint32_t *)wp + (full * GROUP + b) * VL, sizeof w);
                const vf lo = (vf)(w << 16);
                for (int t = 0; t < tb; t++)
                    acc[t][b] = fma_v(lo, splat(x[t * in + in - 1]), acc[t][b]);
            }
    } else {
        const float *x = xp;
        for (int64_t i = 0; i < in; i++) {
            prefetch_ahead((const float *)wp + i * GROUP * VL, GROUP * VL * 4);
            vf w[GROUP];
            for (int b = 0; b < GROUP; b++) w[b] = loadv((const float *)wp + (i * GROUP + b) * VL);
            for (int t = 0; t < tb; t++) {
                const vf xv = splat(x[t * in + i]);
                for (int b = 0; b < GROUP; b++) acc[t][b] = fma_v(w[b], xv, acc[t][b]);
            }
        }
    }
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++) storev(y + (t * GROUP + b) * VL, acc[t][b]);
}

/* Rows quantized for I8 weights: x [T, in_q] int8 (the inputs past `in` zero), and per row
 * and block of QB inputs its scale and the sum of its int8 values. */
typedef struct {
    int8_t *x;
    float *scale;
    int32_t *sum;
    int64_t in_q, nblk;
} QRows;

/* Block j of row r (n <= QB inputs) quantized into its bytes, scale and sum. */
static inline void quantize_block(const float *r, int64_t n, int8_t *out, float *scale,
                                  int32_t *sum) {
#if VL == 16
    if (n == QB) {          /* the same bits as the loop below, 16 at a time */
        const __m512 a = _mm512_loadu_ps(r), b = _mm512_loadu_ps(r + 16);
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 id = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        /* rounded to nearest even, as nearbyintf in the default rounding mode */
        const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(
            _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), lo), hi);
        const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(
            _mm512_cvtps_epi32(_mm512_mul_ps(b, id)), lo), hi);
        _mm_storeu_si128((void *)out, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((void *)(out + 16), _mm512_cvtepi32_epi8(qb));
        *scale = m / 127.f;
        *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        return;
    }
#elif defined(__AVX2__)
    if (n == QB) {          /* the same bits as the loop below (whose fmaxf and nearbyintf
                             * are calls per input without -ffast-math), 8 at a time */
        __m256 a[4], mx = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            a[k] = _mm256_loadu_ps(r + 8 * k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), a[k]));
        }
        float b[8], m = 0.f;
        _mm256_storeu_ps(b, mx);
        for (int l = 0; l < 8; l++) m = b[l] > m ? b[l] : m;
        const __m256 id = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        __m256i q[4], s = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {    /* rounded to nearest even, as nearbyintf */
            q[k] = _mm256_min_epi32(_mm256_max_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(a[k], id)), lo), hi);
            s = _mm256_add_epi32(s, q[k]);
        }
        /* packing works within 128-bit lanes: dword k of the result holds inputs 4k..4k+3
         * after the permutation */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((void *)out, _mm256_permutevar8x32_epi32(
            bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        int32_t si[8];
        _mm256_storeu_si256((void *)si, s);
        int32_t total = 0;
        for (int l = 0; l < 8; l++) total += si[l];
        *scale = m / 127.f;
        *sum = total;
        return;
    }
#endif
    float m = 0.f;
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(r[i]));
    const float id = m > 0.f ? 127.f / m : 0.f;
    int32_t s = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t v = (int32_t)nearbyintf(r[i] * id);
        out[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
        s += out[i];
    }
    *scale = m / 127.f;
    *sum = s;
}

/* x [T, in] -> q (allocated here; free_qrows): each block of QB inputs as round(x / d), d =
 * max |x| / 127 over the block (0 for an all-zero block). Returns -1 when out of memory. */
static int quantize_rows(const float *x, int64_t T, int64_t in, QRows *q, int nthreads) {
    q->nblk = (in + QB - 1) / QB;
    q->in_q = q->nblk * QB;
    q->x = calloc((size_t)(T * q->in_q), 1);
    q->scale = malloc(sizeof(float) * T * q->nblk);
    q->sum = malloc(sizeof(int32_t) * T * q->nblk);
    if (!q->x || !q->scale || !q->sum) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T * in >= 1 << 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < q->nblk; j++)
            quantize_block(x + t * in + j * QB, in - j * QB < QB ? in - j * QB : QB,
                           q->x + t * q->in_q + j * QB, q->scale + t * q->nblk + j,
                           q->sum + t * q->nblk + j);
    return 0;
}

static void free_qrows(QRows *q) {
    free(q->x);
    free(q->scale);
    free(q->sum);
}

/* One unit of four inputs for n rows: isum[t][b] += the integer dot products of the unit's
 * GROUP vectors of offset bytes at wu (int8 weights + 128, four inputs of a column per 32-bit
 * lane) with row t's four int8 inputs at xu + t ld. On AVX512-VNNI and in plain code the sums
 * carry the offset (128 times the inputs' sum: I8_OFFSET), on AVX2 none. */
static inline __attribute__((always_inline)) void dot_bytes(vi isum[CHUNK][GROUP],
                                                           const uint8_t *wu, const int8_t *xu,
                                                           int64_t ld, int n) {
#if defined(__AVX512VNNI__) && VL == 16
    __m512i w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = _mm512_loadu_si512((const void *)(wu + b * VL * 4));
    for (int t = 0; t < n; t++) {
        int32_t x4;
        memcpy(&x4, xu + t * ld, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        for (int b = 0; b < GROUP; b++)
            isum[t][b] = (vi)_mm512_dpbusd_epi32((__m512i)isum[t][b], w[b], xb);
    }
#elif I8_AVX2
    /* No byte dot product into 32-bit sums: the signed weight (the offset byte's top bit
     * flipped) takes the input's sign, and that times |input| sums in pairs to at most
     * 2 * 127 * 127, inside 16 bits (never saturating), then in fours to 32 bits. The sums then
     * carry no offset. Scalar code per byte ran int8 slower than bfloat16. */
    const __m256i flip = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi16(1);
    __m256i w[GROUP];
    for (int b = 0; b < GROUP; b++)
        w[b] = _mm256_xor_si256(_mm256_loadu_si256((const void *)(wu + b * VL * 4)), flip);
    for (int t = 0; t < n; t++) {
        int32_t x4;
        memcpy(&x4, xu + t * ld, 4);
        const __m256i xb = _mm256_set1_epi32(x4), ax = _mm256_abs_epi8(xb);
        for (int b = 0; b < GROUP; b++)
            isum[t][b] += (vi)_mm256_madd_epi16(
                _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[b], xb)), one);
    }
#else
    for (int b = 0; b < GROUP; b++) {
        vi w;
        memcpy(&w, wu + b * VL * 4, sizeof w);
        for (int t = 0; t < n; t++)
            for (int k = 0; k < 4; k++)
                isum[t][b] += ((w >> (8 * k)) & 0xff) * (int32_t)xu[t * ld + k];
    }
#endif
}

/* An I8 tile of tb <= ROWS rows of q from row t0: weights packed per group as [in_q / 4]
 * [GROUP][VL][4] bytes, each the int8 weight + 128 (unsigned, what the dot product instruction
 * takes), then the group's GROUP VL float32 column scales. Block by block, the rows CHUNK at
 * a time (their integer sums in registers) while the block's weights stay in L1: a verify
 * step of up to CHUNK rows then loads each weight vector once, where three rows at a time
 * loaded it again per chunk and cost a verify step markedly more. A block's integer sum is
 * exact; subtracting 128 times the block's input sum takes the offset back. */
static inline __attribute__((always_inline)) void tile_i8(const uint8_t *wp, const QRows *q,
                                                         int64_t t0, int tb, float *y) {
    vf acc[ROWS][GROUP];
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++) acc[t][b] = (vf){0};
    for (int64_t j = 0; j < q->nblk; j++) {
        const uint8_t *wj = wp + j * QB * GROUP * VL;
        for (int c = 0; c < tb; c += CHUNK) {
            const int n = tb - c < CHUNK ? tb - c : CHUNK;
            vi isum[CHUNK][GROUP];
            for (int t = 0; t < n; t++)
                for (int b = 0; b < GROUP; b++) isum[t][b] = (vi){0};
            for (int u = 0; u < QB / 4; u++) {
                const uint8_t *wu = wj + u * GROUP * VL * 4;
                const int8_t *xu = q->x + (t0 + c) * q->in_q + j * QB + u * 4;
                if (c == 0 && tb <= PREFETCH_ROWS_BYTES) prefetch_ahead(wu, GROUP * VL * 4);
                dot_bytes(isum, wu, xu, q->in_q, n);
            }
            for (int t = 0; t < n; t++) {
                const int64_t r = (t0 + c + t) * q->nblk + j;
                const float d = q->scale[r];
                const int32_t off = I8_OFFSET * q->sum[r];
                for (int b = 0; b < GROUP; b++)
                    acc[c + t][b] = fma_v(__builtin_convertvector(isum[t][b] - off, vf),
                                          splat(d), acc[c + t][b]);
            }
        }
    }
    const float *scale = (const float *)(wp + q->in_q * GROUP * VL);
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++)
            storev(y + (t * GROUP + b) * VL, acc[t][b] * loadv(scale + b * VL));
}

/* VL float16 values widened to float32 */
static inline vf widen_f16(const uint16_t *p) {
#if VL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const void *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const void *)p));
#else
    vf v;
    for (int i = 0; i < VL; i++) {
        const uint32_t h = p[i], e = (h >> 10) & 31, f = h & 1023;
        const float m = e ? ldexpf((float)(f | 1024), (int)e - 25) : ldexpf((float)f, -24);
        v[i] = (h >> 15 ? -1.f : 1.f) * (e == 31 ? (f ? NAN : INFINITY) : m);
    }
    return v;
#endif
}

/* A Q4 / Q8 tile of tb <= ROWS rows of q from row t0: llama.cpp's blocks, a weight being
 * d u + m for its unsigned value u and its column's float16 d and m in its block of QB inputs
 * (Q4_0: m = -8 d; Q4_1: its own m; Q8_0: u = the int8 value + 128, m = 0). Per group and
 * block: the values as [units][GROUP][VL][4] bytes, then GROUP VL d, then (Q4) GROUP VL m. Q4:
 * unit p (0..3) holds bytes 4p..4p+3 of each column's 16 as a file's block has them, the low
 * nibbles inputs 4p..4p+3, the high ones inputs 16 + 4p..16 + 4p + 3; Q8: unit p holds inputs
 * 4p..4p+3. A block's integer sum of u times the rows' int8 inputs is exact, and
 * sum_i w_i x_i = dx (d isum + m sum_i xq_i) is taken in float32 block by block, in order:
 * the same operations for every row count. Blocks are small, so the rows pass CHUNK at a
 * time per block, as in tile_i8. */
static inline __attribute__((always_inline)) void tile_q(const uint8_t *wp, int bits,
                                                        const QRows *q, int64_t t0, int tb,
                                                        float *y) {
    /* Q8 blocks carry no m (Q8_0's is 0): a block's bytes are its values and d */
    const int64_t W = GROUP * VL, vbytes = QB * W * bits / 8, sbytes = (bits == 8 ? 2 : 4) * W;
    vf acc[ROWS][GROUP];
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++) acc[t][b] = (vf){0};
    for (int64_t j = 0; j < q->nblk; j++) {
        const uint8_t *wj = wp + j * (vbytes + sbytes);
        const uint16_t *dh = (const uint16_t *)(wj + vbytes), *mh = dh + W;
        vf d[GROUP], m[GROUP];
        for (int b = 0; b < GROUP; b++) {
            d[b] = widen_f16(dh + b * VL);
            if (bits == 4) m[b] = widen_f16(mh + b * VL);
        }
        for (int c = 0; c < tb; c += CHUNK) {
            const int n = tb - c < CHUNK ? tb - c : CHUNK;
            vi isum[CHUNK][GROUP];
            for (int t = 0; t < n; t++)
                for (int b = 0; b < GROUP; b++) isum[t][b] = (vi){0};
            for (int u = 0; u < QB * bits / 32; u++) {
                const uint8_t *wu = wj + u * W * 4;
                const int8_t *xu = q->x + (t0 + c) * q->in_q + j * QB + u * 4;
                if (c == 0 && tb <= PREFETCH_ROWS_BYTES) prefetch_ahead(wu, W * 4);
                if (bits == 8) {
                    dot_bytes(isum, wu, xu, q->in_q, n);
                    continue;
                }
                /* nibbles: the low ones times inputs 4p.., the high ones times 16 + 4p.. */
#if defined(__AVX512VNNI__) && VL == 16
                const __m512i low4 = _mm512_set1_epi8(0x0f);
                __m512i lo[GROUP], hi[GROUP];
                for (int b = 0; b < GROUP; b++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(wu + b * VL * 4));
                    lo[b] = _mm512_and_si512(w, low4);
                    hi[b] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
                }
                for (int t = 0; t < n; t++) {
                    int32_t xl, xh;
                    memcpy(&xl, xu + t * q->in_q, 4);
                    memcpy(&xh, xu + t * q->in_q + 16, 4);
                    const __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
                    for (int b = 0; b < GROUP; b++)
                        isum[t][b] = (vi)_mm512_dpbusd_epi32(
                            _mm512_dpbusd_epi32((__m512i)isum[t][b], lo[b], bl), hi[b], bh);
                }
#elif I8_AVX2
                /* nibbles (at most 15) times int8 sum in 16-bit pairs without saturating */
                const __m256i one = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
                __m256i lo[GROUP], hi[GROUP];
                for (int b = 0; b < GROUP; b++) {
                    const __m256i w = _mm256_loadu_si256((const void *)(wu + b * VL * 4));
                    lo[b] = _mm256_and_si256(w, low4);
                    hi[b] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                }
                for (int t = 0; t < n; t++) {
                    int32_t xl, xh;
                    memcpy(&xl, xu + t * q->in_q, 4);
                    memcpy(&xh, xu + t * q->in_q + 16, 4);
                    const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
                    for (int b = 0; b < GROUP; b++)
                        isum[t][b] += (vi)_mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo[b], bl),
                                             _mm256_maddubs_epi16(hi[b], bh)), one);
                }
#else
                for (int b = 0; b < GROUP; b++) {
                    vi w;
                    memcpy(&w, wu + b * VL * 4, sizeof w);
                    for (int t = 0; t < n; t++)
                        for (int k = 0; k < 4; k++) {
                            const int8_t *xk = xu + t * q->in_q + k;
                            isum[t][b] += ((w >> (8 * k)) & 0xf) * (int32_t)xk[0]
                                          + ((w >> (8 * k + 4)) & 0xf) * (int32_t)xk[16];
                        }
                }
#endif
            }
            for (int t = 0; t < n; t++) {
                const int64_t r = (t0 + c + t) * q->nblk + j;
                const float dx = q->scale[r], sx = (float)q->sum[r] * dx;
                const int32_t off = bits == 8 ? I8_OFFSET * q->sum[r] : 0;
                /* the block's sum before the running one: its terms cancel (Q4_0: m = -8 d);
                 * Q8's fma with m = 0 would round as this product does */
                for (int b = 0; b < GROUP; b++)
                    acc[c + t][b] += bits == 8
                        ? __builtin_convertvector(isum[t][b] - off, vf) * (d[b] * dx)
                        : fma_v(__builtin_convertvector(isum[t][b] - off, vf), d[b] * dx,
                                m[b] * sx);
            }
        }
    }
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < GROUP; b++) storev(y + (t * GROUP + b) * VL, acc[t][b]);
}

_Static_assert(ROWS == 2 || ROWS == 5 || ROWS == 6, "the tile switches list cases 1..ROWS");
#define TILE_I8(TB) case TB: tile_i8(wt, &q, t0, TB, buf); break;
#define TILE_Q(TB, BITS) case TB: tile_q(wt, BITS, &q, t0, TB, buf); break;
#if ROWS == 6
#define MORE_TILES_I8 TILE_I8(3) TILE_I8(4) TILE_I8(5) TILE_I8(6)
#define MORE_TILES_Q(BITS) TILE_Q(3, BITS) TILE_Q(4, BITS) TILE_Q(5, BITS) TILE_Q(6, BITS)
#elif ROWS == 5
#define MORE_TILES_I8 TILE_I8(3) TILE_I8(4) TILE_I8(5)
#define MORE_TILES_Q(BITS) TILE_Q(3, BITS) TILE_Q(4, BITS) TILE_Q(5, BITS)
#else
#define MORE_TILES_I8
#define MORE_TILES_Q(BITS)
#endif
#define TILES_Q(BITS) switch (n) { TILE_Q(1, BITS) TILE_Q(2, BITS) MORE_TILES_Q(BITS) }

/* bfloat16 bits of f, rounded to nearest even */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
}

/* How a PAIRS tile takes its inputs: as bfloat16 pairs (uint32) for AVX512-BF16's pair
 * products, else as floats rounded to bfloat16, two per pair: a broadcast load each, where
 * unpacking a pair per row and input cost a few instructions beside its two products. */
#if defined(__AVX512BF16__) && VL == 16
#define PAIRS_FLOATS 0
#else
#define PAIRS_FLOATS 1
#endif

/* rows [T, in] of floats -> [T, ceil(in / 2)] bfloat16 pairs (input 2i in the low half) as
 * uint32, or (PAIRS_FLOATS) as two floats holding those bfloat16 values */
static void to_pairs(const float *x, int64_t T, int64_t in, void *out) {
    const int64_t in2 = (in + 1) / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < in2; i++) {
            const float *r = x + t * in + 2 * i;
            const uint32_t lo = bf16_bits(r[0]), hi = 2 * i + 1 < in ? bf16_bits(r[1]) : 0;
            if (PAIRS_FLOATS) {
                const uint32_t f[2] = {lo << 16, hi << 16};
                memcpy((float *)out + 2 * (t * in2 + i), f, 8);
            } else {
                ((uint32_t *)out)[t * in2 + i] = lo | hi << 16;
            }
        }
}

int specserve_block(void) { return VL; }

/* The longest step the kernel takes whole; longer prompt chunks run layer by layer through
 * PyTorch, their matrix products still in specserve_linear. In a throwaway timing of the
 * bundled target's forward on a Zen 4 machine, the kernel built for AVX-512 was the faster at
 * every length up to 512 rows (in bfloat16 2.3-3.4x from 64 rows on, in float32 1.3-2.1x);
 * built for haswell (AVX2) it tied at 64 rows and was 1.5x slower at 512. */
int specserve_max_rows(void) { return VL == 16 ? 512 : 48; }

#define TILE(TB, MODE) case TB: tile(wt, MODE, xg, in_x, TB, buf); break;
#if ROWS == 6
#define MORE_TILES(MODE) TILE(3, MODE) TILE(4, MODE) TILE(5, MODE) TILE(6, MODE)
#elif ROWS == 5
#define MORE_TILES(MODE) TILE(3, MODE) TILE(4, MODE) TILE(5, MODE)
#else
#define MORE_TILES(MODE)
#endif
#define TILES(MODE) switch (n) { TILE(1, MODE) TILE(2, MODE) MORE_TILES(MODE) }

/* out[t, o0 + j] (+)= bias[o0 + j] + buf[t, j] for the m columns of a tile */
static inline void put_rows(const float *buf, int64_t n, int64_t m, const float *bias,
                            float *y, int64_t ldy, int accumulate) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < m; j++) {
            float v = buf[t * GROUP * VL + j] + (bias ? bias[j] : 0.f);
            y[t * ldy + j] = accumulate ? y[t * ldy + j] + v : v;
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && VL == 16 \
    && defined(__linux__)
#define HAVE_AMX 1
/* AMX (Sapphire Rapids and later): one tile instruction multiplies up to 16 rows by a 16-pair
 * slice of 16 columns (8192 products), where AVX-512 takes 16 rows x 16 columns one FMA of
 * 16 products at a time: a verify step of several rows then costs what one row does (the
 * weights' bytes), not its products. PAIRS weights are already laid out as AMX's B tiles
 * want them (16 columns of one input pair per 64 bytes, the next pair GROUP blocks further
 * on), so no other copy is packed. Each output is computed from its own row and column alone,
 * whatever the other rows: batch invariance holds as on the AVX-512 path. */
static int amx_state = -1;      /* -1 unknown, 0 refused by the OS, 1 enabled */

static int amx_enabled(void) {
    if (amx_state < 0)          /* Linux hands tile state to a process only when asked */
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0-3: the group's four 16-column accumulators; 4: M rows of 16 input pairs; 5: a
 * weight slice */
static void amx_config(int M) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t == 5 ? 16 : M;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* buf[t, 64] = the M rows of xp (bfloat16 pairs, row stride in pairs) times one group */
static void amx_group(const uint32_t *wp, const uint32_t *xp, int64_t in, float *buf) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t wstride = GROUP * VL * 4;       /* bytes from one input pair to the next */
    for (int64_t i = 0; i < in; i += 16) {
        _tile_loadd(4, xp + i, in * 4);
        _tile_loadd(5, wp + (i * GROUP + 0) * VL, wstride);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, wp + (i * GROUP + 1) * VL, wstride);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, wp + (i * GROUP + 2) * VL, wstride);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, wp + (i * GROUP + 3) * VL, wstride);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, buf, GROUP * VL * 4);
    _tile_stored(1, buf + VL, GROUP * VL * 4);
    _tile_stored(2, buf + 2 * VL, GROUP * VL * 4);
    _tile_stored(3, buf + 3 * VL, GROUP * VL * 4);
}

/* specserve_linear for PAIRS weights whose input pairs fill whole 16-pair slices */
static void linear_amx(const uint32_t *x, int64_t T, const uint32_t *wp, const float *bias,
                       int64_t out, int64_t in, float *y, int64_t ldy, int accumulate,
                       int nthreads) {
    const int64_t width = GROUP * VL, ntiles = (out + width - 1) / width;
    #pragma omp parallel num_threads(nthreads)
    {
        float buf[16 * GROUP * VL];
        int configured = 0;
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < ntiles; c++) {
            const uint32_t *wt = wp + c * in * GROUP * VL;
            const int64_t o0 = c * width, m = out - o0 < width ? out - o0 : width;
            for (int64_t t0 = 0; t0 < T; t0 += 16) {
                const int M = T - t0 < 16 ? (int)(T - t0) : 16;
                if (M != configured) {
                    amx_config(M);
                    configured = M;
                }
                amx_group(wt, x + t0 * in, in, buf);
                put_rows(buf, M, m, bias ? bias + o0 : NULL, y + t0 * ldy + o0, ldy, accumulate);
            }
        }
        if (configured) _tile_release();
    }
}
#endif

/* 1 when bfloat16-pair products of inputs a multiple of 32 wide run on AMX tiles */
int specserve_amx(void) {
#ifdef HAVE_AMX
    return amx_enabled();
#else
    return 0;
#endif
}

/* y[t, o] (+)= bias[o] + sum_i W[o, i] x[t, i] for t < T, o < out, with W packed in `mode`
 * (F32, BF16, PAIRS, I8, Q4, Q8); y has row stride ldy. Threads split the tiles of GROUP blocks; a tile
 * runs its rows ROWS at a time (as evenly as that allows), so its weights come from memory
 * once and from cache for the other passes. Returns 0, or -1 when out of memory. */
int specserve_linear(const float *x, int64_t T, const void *wp, int mode, const float *bias,
                     int64_t out, int64_t in, float *y, int64_t ldy, int accumulate,
                     int nthreads) {
    /* an input row: in_x floats or bfloat16 pairs, 4 bytes each; a packed input: a float or
     * a pair of bfloat16 values per column */
    const int64_t in_x = mode == PAIRS ? (in + 1) / 2 : in;
    /* bytes of a packed group of GROUP VL columns */
    const int64_t nblk = (in + QB - 1) / QB;
    const int64_t group_bytes = mode == I8 ? (nblk * QB + 4) * GROUP * VL
                                : mode == Q4 ? nblk * (QB / 2 + 4) * GROUP * VL
                                : mode == Q8 ? nblk * (QB + 2) * GROUP * VL
                                : (mode == F32 ? in : (in + 1) / 2) * GROUP * VL * 4;
    if (T == 0) return 0;
    const void *xs = x;
    void *pairs = NULL;
    /* bytes of an input row as the tiles take it */
    const int64_t row_bytes = mode == PAIRS && PAIRS_FLOATS ? in_x * 8 : in_x * 4;
    QRows q = {0};
    if ((mode == I8 || mode == Q4 || mode == Q8) && quantize_rows(x, T, in, &q, nthreads)) {
        free_qrows(&q);
        return -1;
    }
    if (mode == PAIRS) {
        if (!(pairs = malloc(row_bytes * T))) return -1;
        to_pairs(x, T, in, pairs);
        xs = pairs;
#ifdef HAVE_AMX
        if (in_x % 16 == 0 && amx_enabled()) {
            linear_amx(pairs, T, wp, bias, out, in_x, y, ldy, accumulate, nthreads);
            free(pairs);
            return 0;
        }
#endif
    }
    const int64_t width = GROUP * VL, ntiles = (out + width - 1) / width;
    const int64_t passes = (T + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < ntiles; c++) {
        float buf[ROWS * GROUP * VL];
        const void *wt = (const char *)wp + c * group_bytes;
        const int64_t o0 = c * width, m = out - o0 < width ? out - o0 : width;
        for (int64_t k = 0, t0 = 0; k < passes; k++) {
            const int64_t n = T / passes + (k < T % passes);
            const void *xg = (const char *)xs + t0 * row_bytes;
            if (mode == PAIRS) {
                TILES(PAIRS)
            } else if (mode == BF16) {
                TILES(BF16)
            } else if (mode == I8) {
                switch (n) { TILE_I8(1) TILE_I8(2) MORE_TILES_I8 }
            } else if (mode == Q4) {
                TILES_Q(4)
            } else if (mode == Q8) {
                TILES_Q(8)
            } else {
                TILES(F32)
            }
            put_rows(buf, n, m, bias ? bias + o0 : NULL, y + t0 * ldy + o0, ldy, accumulate);
            t0 += n;
        }
    }
    free(pairs);
    free_qrows(&q);
    return 0;
}

/* Greedy rows of a vocabulary projection read through an int8 screen (specserve_screen):
 * the argmax needs only the logits that may be the largest. The screen's int8 product (half
 * the bytes of bfloat16 weights) gives every logit within a bound of its exact value; the
 * columns whose upper bound reaches the largest lower bound are the candidates, and only
 * their exact logits are computed, by the same tile code over a gathered copy of their
 * weights (a lane's sums do not depend on its neighbours): bit for bit the full product's.
 * With s the column's scale, |w - s q| <= s / 2 per weight, and per block j of QB inputs the
 * inputs' quantization error is at most d_j / 2 (d_j their scale), so
 *   |exact - screen| <= s (sum_i |x_i| / 2 + sum_j d_j / 2 sum_{i in j} |q_i|),
 * widened by SCREEN_SLACK for the float32 roundings of both (each well under 1% of it). */
typedef struct {
    const float *x;             /* [T, in] */
    int64_t T, in, out;
    const void *screen;         /* the weight packed as I8 */
    const uint16_t *absq;       /* [nblk, out]: sum of |q| over each block of a column */
    const float *scale;         /* [out]: the screen's column scales */
    const void *wp;             /* the weight as its full product takes it */
    int mode;                   /* F32, BF16 or PAIRS */
    const float *rows;          /* [out, in]: the weight row-major (a tied embedding), where a
                                 * candidate's column is one run of bytes; NULL: read it from wp */
    int64_t max_candidates;     /* a row with more has its whole product computed */
    float *y;                   /* [T, out]: candidates' exact logits, -inf elsewhere */
    int64_t *ncand;             /* [T]: each row's candidates (out where computed whole) */
    int nthreads;
} ScreenArgs;

size_t specserve_screen_args_size(void) { return sizeof(ScreenArgs); }

#define SCREEN_SLACK 1.05f
#define SCREEN_CHUNK 1024

/* Candidates ids[0..m) (m <= GROUP VL) of one row into yrow at their exact values: their
 * columns gathered into a one-group packing (mini, in_x GROUP VL entries) and run through the
 * tile the full product uses, so each value is the full product's, bit for bit (a lane's sum
 * does not depend on its neighbours). A column comes from the row-major copy where there is
 * one (one run of in floats; from wp, in_x loads a group apart), its values packed as
 * pack_weight packs them. */
static void screen_exact(const ScreenArgs *a, const void *xrow, const int64_t *ids, int64_t m,
                         float *yrow, uint32_t *mini) {
    /* 4-byte entries a column holds per group (BF16 and PAIRS: input pairs), and the `in`
     * the tile takes (PAIRS counts pairs), as in specserve_linear */
    const int64_t W = GROUP * VL, in = a->in, in_x = a->mode == F32 ? in : (in + 1) / 2;
    const int64_t tile_in = a->mode == PAIRS ? in_x : in;
    const uint32_t *src = a->wp;
    float buf[ROWS * GROUP * VL];
    memset(mini, 0, sizeof(uint32_t) * in_x * W);
    for (int64_t k = 0; k < m; k++) {
        const int64_t v = ids[k];
        uint32_t *dst = mini + (k / VL) * VL + k % VL;
        if (a->rows && a->mode == F32) {
            for (int64_t i = 0; i < in; i++) memcpy(dst + i * W, a->rows + v * in + i, 4);
        } else if (a->rows) {
            const float *r = a->rows + v * in;
            for (int64_t i = 0; i < in_x; i++)
                dst[i * W] = bf16_bits(r[2 * i]) | (2 * i + 1 < in ? bf16_bits(r[2 * i + 1]) : 0)
                                                       << 16;
        } else {
            const int64_t g = v / W, b = (v % W) / VL, l = v % VL;
            const uint32_t *col = src + g * in_x * W + b * VL + l;
            for (int64_t i = 0; i < in_x; i++) dst[i * W] = col[i * W];
        }
    }
    tile(mini, a->mode, xrow, tile_in, 1, buf);
    for (int64_t k = 0; k < m; k++) yrow[ids[k]] = buf[k];
}

int specserve_screen(const ScreenArgs *a) {
    const int64_t T = a->T, in = a->in, out = a->out, nblk = (in + QB - 1) / QB;
    const int nthreads = a->nthreads;
    if (T == 0) return 0;
    int whole = 0;
#ifdef HAVE_AMX
    whole = a->mode == PAIRS && ((a->in + 1) / 2) % 16 == 0 && amx_enabled();
#endif
    if (whole) {                /* AMX sums in its own order: the full product, as it runs */
        for (int64_t t = 0; t < T; t++) a->ncand[t] = out;
        return specserve_linear(a->x, T, a->wp, a->mode, NULL, out, in, a->y, out, 0, nthreads);
    }
    /* PAIRS products take the inputs rounded to bfloat16: the bound is about those */
    const int64_t in_x = a->mode == F32 ? in : (in + 1) / 2;
    const int64_t row_bytes = a->mode == PAIRS && PAIRS_FLOATS ? in_x * 8 : in_x * 4;
    float *xr = a->mode == PAIRS ? malloc(sizeof(float) * T * in) : NULL;
    float *half = malloc(sizeof(float) * T * (nblk + 1));
    /* candidates are listed per row and thread, each list holding up to the row's limit */
    const int nt = nthreads < 64 ? nthreads : 64;
    const int64_t cap = a->max_candidates + 1;
    float *ub = malloc(sizeof(float) * T * out), *lower = malloc(sizeof(float) * T * 64);
    int64_t *ids = malloc(sizeof(int64_t) * T * nt * cap);
    int64_t *counts = malloc(sizeof(int64_t) * T * nt);
    uint32_t *mini = malloc(sizeof(uint32_t) * nt * in_x * GROUP * VL);   /* one a thread */
    void *xs = a->mode == PAIRS ? malloc(row_bytes * T) : NULL;
    /* the rows computed whole (their inputs, their products), and the candidates' items:
     * row t's list from entry c at t cap + c */
    int64_t *whole_rows = malloc(sizeof(int64_t) * T);
    int64_t *items = malloc(sizeof(int64_t) * T * (cap / (GROUP * VL) + 1));
    float *xw = NULL, *yw = NULL;
    int rc = -1;
    if (!half || !ub || !lower || !ids || !counts || !mini || !whole_rows || !items
        || (a->mode == PAIRS && (!xs || !xr)))
        goto done;
    if (a->mode == PAIRS) {
        for (int64_t i = 0; i < T * in; i++) {
            const uint32_t u = bf16_bits(a->x[i]) << 16;
            memcpy(xr + i, &u, 4);
        }
        to_pairs(a->x, T, in, xs);
    }
    const float *xb = a->mode == PAIRS ? xr : a->x;     /* the inputs the bound is about */
    if (specserve_linear(xb, T, a->screen, I8, NULL, out, in, a->y, out, 0, nthreads)) goto done;
    /* per row: half its inputs' absolute sum, then half of each block's input scale */
    for (int64_t t = 0; t < T; t++) {
        double sum = 0;
        for (int64_t j = 0; j < nblk; j++) {
            float mx = 0.f;
            for (int64_t i = j * QB; i < in && i < (j + 1) * QB; i++) {
                const float v = fabsf(xb[t * in + i]);
                sum += v;
                mx = v > mx ? v : mx;
            }
            half[t * (nblk + 1) + 1 + j] = mx / 127.f * 0.5f;
        }
        half[t * (nblk + 1)] = (float)(sum * 0.5);
    }
    for (int64_t i = 0; i < T * 64; i++) lower[i] = -INFINITY;
    for (int64_t i = 0; i < T * nt; i++) counts[i] = 0;
    #pragma omp parallel num_threads(nt)
    {
        const int me = omp_get_thread_num();
        /* pass 1: each column's upper bound (into ub) and each thread's best lower bound */
        #pragma omp for schedule(static)
        for (int64_t v0 = 0; v0 < out; v0 += SCREEN_CHUNK) {
            const int64_t n = out - v0 < SCREEN_CHUNK ? out - v0 : SCREEN_CHUNK;
            float e[SCREEN_CHUNK];
            for (int64_t t = 0; t < T; t++) {
                const float *h = half + t * (nblk + 1);
                for (int64_t v = 0; v < n; v++) e[v] = h[0];
                for (int64_t j = 0; j < nblk; j++) {
                    const uint16_t *aj = a->absq + j * out + v0;
                    const float d = h[1 + j];
                    for (int64_t v = 0; v < n; v++) e[v] += d * (float)aj[v];
                }
                float lo = lower[t * 64 + me];
                const float *yt = a->y + t * out + v0;
                float *ut = ub + t * out + v0;
                for (int64_t v = 0; v < n; v++) {
                    const float ev = a->scale[v0 + v] * e[v] * SCREEN_SLACK + 1e-6f;
                    lo = yt[v] - ev > lo ? yt[v] - ev : lo;
                    ut[v] = yt[v] + ev;
                }
                lower[t * 64 + me] = lo;
            }
        }           /* the loop's barrier: every thread's lower bound is in */
        /* pass 2: the columns whose upper bound reaches the row's best lower bound, into
         * this thread's list; the others' logits to -inf */
        #pragma omp for schedule(static)
        for (int64_t v0 = 0; v0 < out; v0 += SCREEN_CHUNK) {
            const int64_t n = out - v0 < SCREEN_CHUNK ? out - v0 : SCREEN_CHUNK;
            for (int64_t t = 0; t < T; t++) {
                float L = -INFINITY;
                for (int k = 0; k < nt; k++) L = lower[t * 64 + k] > L ? lower[t * 64 + k] : L;
                if (!isfinite(L) || !isfinite(half[t * (nblk + 1)])) continue;  /* whole */
                float *yt = a->y + t * out + v0;
                const float *ut = ub + t * out + v0;
                int64_t *mine = ids + (t * nt + me) * cap, c = counts[t * nt + me];
                for (int64_t v = 0; v < n; v++) {
                    if (ut[v] >= L) {
                        if (c < cap) mine[c] = v0 + v;
                        c++;
                    } else {
                        yt[v] = -INFINITY;
                    }
                }
                counts[t * nt + me] = c;
            }
        }
    }
    /* each row's candidates joined into one list; rows with none or too many (not worth it,
     * or not finite) are computed whole, all in one product; the others' candidates run in
     * items of GROUP VL on every thread */
    int64_t nwhole = 0, nitems = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t n = 0;
        for (int k = 0; k < nt; k++) n += counts[t * nt + k];
        int64_t *list = ids + t * nt * cap;
        if (n == 0 || n > a->max_candidates) {
            a->ncand[t] = out;
            whole_rows[nwhole++] = t;
            continue;
        }
        a->ncand[t] = n;
        for (int64_t k = 1, m = counts[t * nt]; k < nt; m += counts[t * nt + k], k++)
            memmove(list + m, list + k * cap, sizeof(int64_t) * counts[t * nt + k]);
        for (int64_t c = 0; c < n; c += GROUP * VL) items[nitems++] = t * cap + c;
    }
    if (nwhole) {
        xw = malloc(sizeof(float) * nwhole * in);
        yw = malloc(sizeof(float) * nwhole * out);
        if (!xw || !yw) goto done;
        for (int64_t r = 0; r < nwhole; r++)
            memcpy(xw + r * in, a->x + whole_rows[r] * in, sizeof(float) * in);
        if (specserve_linear(xw, nwhole, a->wp, a->mode, NULL, out, in, yw, out, 0, nthreads))
            goto done;
        for (int64_t r = 0; r < nwhole; r++)
            memcpy(a->y + whole_rows[r] * out, yw + r * out, sizeof(float) * out);
    }
    #pragma omp parallel for num_threads(nt) schedule(dynamic)
    for (int64_t it = 0; it < nitems; it++) {
        const int64_t t = items[it] / cap, c = items[it] % cap, n = a->ncand[t];
        screen_exact(a, a->mode == PAIRS ? (const char *)xs + t * row_bytes
                                         : (const void *)(a->x + t * in),
                     ids + t * nt * cap + c, n - c < GROUP * VL ? n - c : GROUP * VL,
                     a->y + t * out, mini + (int64_t)omp_get_thread_num() * in_x * GROUP * VL);
    }
    rc = 0;
done:
    free(xr); free(half); free(ub); free(lower); free(ids); free(counts); free(mini); free(xs);
    free(whole_rows); free(items); free(xw); free(yw);
    return rc;
}

/* Reads the n buffers (ptrs[i], bytes[i] each, the tail past a multiple of 256 left) once,
 * in order, on nthreads threads, each taking a contiguous share of every buffer (as
 * specserve_linear shares a weight's tiles) and going on to the next without waiting for
 * the others, asking PREFETCH ahead as the tiles do: no arithmetic but an XOR of what it
 * loads, so its time bounds from below a pass that streams those very bytes. Four lines per
 * iteration, each with its own XOR chain: one line at a time read a third slower. Returns
 * the XOR (kept live). */
int64_t specserve_stream(const void *const *ptrs, const int64_t *bytes, int64_t n,
                         int nthreads) {
    enum { L = 64 / sizeof(vi), U = 4 };       /* vectors a cache line holds; lines a step */
    vi acc = {0};
    #pragma omp parallel num_threads(nthreads)
    {
        vi a[U][L] = {{{0}}};
        for (int64_t b = 0; b < n; b++) {
            const char *p = ptrs[b];
            #pragma omp for schedule(static) nowait
            for (int64_t s = 0; s < bytes[b] / (64 * U); s++)
                for (int u = 0; u < U; u++) {
                    const char *line = p + (s * U + u) * 64;
                    __builtin_prefetch(line + PREFETCH);
                    for (int k = 0; k < L; k++) {
                        vi v;
                        memcpy(&v, line + k * sizeof(vi), sizeof v);
                        a[u][k] ^= v;
                    }
                }
        }
        #pragma omp critical
        for (int u = 0; u < U; u++)
            for (int k = 0; k < L; k++) acc ^= a[u][k];
    }
    int64_t r = 0;
    for (int i = 0; i < VL; i++) r ^= acc[i];
    return r;
}

/* y = weight * x / sqrt(mean(x^2) + eps) over rows of length n */
static void rms_norm(const float *x, const float *weight, float eps, int64_t rows, int64_t n,
                     int64_t ldx, int64_t ldy, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float inv = 1.f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[r * ldy + i] = weight[i] * (xr[i] * inv);
    }
}

/* y = weight * x / sqrt(mean(x^2) + eps) over `rows` contiguous rows of n floats */
void specserve_rms_norm(const float *x, const float *weight, float eps, int64_t rows, int64_t n,
                        float *y) {
    rms_norm(x, weight, eps, rows, n, n, n, y);
}

/* rotate-half rotary in place: x[d] * cos[d] + x[(d + D/2) % D] * signed_sin[d] */
static void rotary(float *x, const float *cos, const float *ssin, int64_t D) {
    float tmp[1024];
    const int64_t half = D / 2;
    memcpy(tmp, x, D * sizeof(float));
    for (int64_t d = 0; d < half; d++) x[d] = tmp[d] * cos[d] + tmp[d + half] * ssin[d];
    for (int64_t d = half; d < D; d++) x[d] = tmp[d] * cos[d] + tmp[d - half] * ssin[d];
}

/* Softmax weights of one query's scores x[0..L) in place, returning their sum; with `keep`,
 * only the keys it marks count and the others weigh exactly 0 (not expv's clamped exp(-87)).
 * Lanes are combined in a fixed order, so the weights depend on the query's scores alone. */
static float softmax_weights(float *x, int64_t L, const uint8_t *keep) {
    float m = -INFINITY, sum = 0.f;
    int64_t j = 0;
    if (!keep) {
        vf mv = (vf){0} - INFINITY;
        for (; j + VL <= L; j += VL) {
            const vf a = loadv(x + j);
            const vi gt = a > mv;
            mv = (vf)(((vi)a & gt) | ((vi)mv & ~gt));
        }
        float b[VL];
        memcpy(b, &mv, sizeof b);
        for (int l = 0; l < VL; l++) m = b[l] > m ? b[l] : m;
    }
    for (; j < L; j++)
        if (!keep || keep[j]) m = x[j] > m ? x[j] : m;
    for (j = 0; j < L; j++) x[j] -= m;
    exp_array(x, x, L);
    if (keep) {
        /* The kept weights summed as if they lay side by side, in the lanes and order the
         * causal sum below gives them: a draft-tree node (its ancestors at other positions
         * than its path's decode puts them) then sums exactly as that decode does. */
        int64_t n = 0;
        for (j = 0; j < L; j++) {
            if (keep[j]) n++;
            else x[j] = 0.f;
        }
        float lanes[VL] = {0};
        int64_t c = 0;
        for (j = 0; j < L && c < n - n % VL; j++)
            if (keep[j]) lanes[c++ % VL] += x[j];
        vf s;
        memcpy(&s, lanes, sizeof s);
        sum = hsum(s);
        for (; j < L; j++)
            if (keep[j]) sum += x[j];
        return sum;
    }
    vf s = {0};
    for (j = 0; j + VL <= L; j += VL) s += loadv(x + j);
    sum = hsum(s);
    for (; j < L; j++) sum += x[j];
    return sum;
}

/* out[q][d] = sum_{j < L} p[q * ldp + j] * v[j * D + d] for nq queries at once, nv = D / VL:
 * each value row is loaded once for all of them, and every output lane sums its products in
 * order of j, as it would for that query alone. */
static inline __attribute__((always_inline)) void wsum_pass(const float *p, int64_t ldp,
                                                            int nq, int nv, int64_t j0,
                                                            int64_t L, const void *v,
                                                            int64_t D, int bf16,
                                                            float *const *out) {
    vf acc[8][8];
    for (int q = 0; q < nq; q++)
        for (int c = 0; c < nv; c++) acc[q][c] = j0 ? loadv(out[q] + c * VL) : (vf){0};
    for (int64_t j = j0; j < L; j++) {
        vf vv[8];
        for (int c = 0; c < nv; c++) vv[c] = load_kv(v, j * D + c * VL, bf16);
        for (int q = 0; q < nq; q++) {
            const vf w = splat(p[q * ldp + j]);
            for (int c = 0; c < nv; c++) acc[q][c] = fma_v(w, vv[c], acc[q][c]);
        }
    }
    for (int q = 0; q < nq; q++)
        for (int c = 0; c < nv; c++) storev(out[q] + c * VL, acc[q][c]);
}

#define WS_ROWS 32       /* value rows a block of passes takes: 8 KB of float32 at D = 64 */
#define WS(NQ, NV) case NQ * 16 + NV: wsum_pass(pr, ldp, NQ, NV, jb, je, vc, D, bf16, out); break;
#define WS8(NV) WS(1, NV) WS(2, NV) WS(3, NV) WS(4, NV) WS(5, NV) WS(6, NV) WS(7, NV) WS(8, NV)

/* The attention outputs of nq queries over the values v [L, D] of one KV head: query r is head
 * r % group of row r / group, whose output goes to o + (r / group) * ld + (r % group) * D;
 * its softmax weights are p + r * ldp, scaled by inv[r], and it sees L = lens[r / group]
 * keys (lens rises). o_r[d] = inv[r] * sum_j p_r[j] v[j * D + d], summed in order of j. */
static void weighted_sums(const float *p, int64_t ldp, int64_t nq, int64_t group,
                          const int64_t *lens, const void *v, int64_t D, int bf16,
                          const float *inv, float *o, int64_t ld) {
    const int64_t nv_all = D % VL == 0 ? D / VL : 0;
    /* a pass sums nv vectors of columns (wider heads in several passes) for `per` queries */
#if VL == 16
    const int64_t nv = nv_all % 8 == 0 ? 8 : nv_all % 4 == 0 ? 4 : nv_all % 2 == 0 ? 2 : 1;
    const int64_t regs = ACC;
#else
    /* AVX2's 16 registers hold the sums, a value row's nv vectors and a weight: passes of
     * a whole 64-wide row took one query each, every query reading all the values from L2
     * again; passes of four vectors for two queries over a block of WS_ROWS values at a time
     * find the block in L1 */
    const int64_t nv = nv_all % 4 == 0 ? 4 : nv_all % 2 == 0 ? 2 : 1;
    const int64_t regs = 16 - nv - 1;
#endif
    const int fast = nv_all > 0;
    const int64_t per = !fast ? 1 : regs / nv < 1 ? 1 : regs / nv < 8 ? regs / nv : 8;
    for (int64_t r0 = 0; r0 < nq; r0 += per) {
        const int64_t n = nq - r0 < per ? nq - r0 : per, Lc = lens[r0 / group];
        const float *pr = p + r0 * ldp;
        float *out[8];
        /* a pass goes on from the sums the block before left in out; the first block runs
         * even with no keys, writing the zeros the loops below go on from */
        for (int64_t jb = 0; fast && (jb == 0 || jb < Lc); jb += WS_ROWS) {
            const int64_t je = Lc - jb < WS_ROWS ? Lc : jb + WS_ROWS;
            for (int64_t c0 = 0; c0 < D; c0 += nv * VL) {
                for (int64_t k = 0; k < n; k++)
                    out[k] = o + (r0 + k) / group * ld + (r0 + k) % group * D + c0;
                const void *vc = (const char *)v + c0 * (bf16 ? 2 : 4);
                switch (n * 16 + nv) { WS8(1) WS8(2) WS8(4) WS8(8) }
            }
        }
        for (int64_t k = 0; k < n; k++)
            out[k] = o + (r0 + k) / group * ld + (r0 + k) % group * D;
        if (!fast) {
            for (int64_t d = 0; d < D; d++) {
                float r = 0.f;
                for (int64_t j = 0; j < Lc; j++) r = fma_s(pr[j], kv_at(v, j * D + d, bf16), r);
                out[0][d] = r;
            }
        }
        for (int64_t k = 0; k < n; k++) {     /* the keys this query sees beyond the pass's */
            const float *pk = pr + k * ldp;
            for (int64_t j = Lc; j < lens[(r0 + k) / group]; j++)
                for (int64_t d = 0; d < D; d++)
                    out[k][d] = fma_s(pk[j], kv_at(v, j * D + d, bf16), out[k][d]);
            for (int64_t d = 0; d < D; d++) out[k][d] *= inv[r0 + k];
        }
    }
}

/* The scores of a block of n <= VL keys (D a multiple of VL): each slice of q is loaded once
 * for all of them (a missing key reads key 0, its score dropped), and their sums advance side by
 * side (one key at a time waited on its adds' latency); then a transposing tree of shuffles adds
 * up every key's lanes at once. Every key goes through the same tree whatever its place in the
 * block, so a score depends on q and its key only. */
#if (VL == 8 || VL == 16) && !defined(__clang__)        /* needs GCC's __builtin_shuffle */
#define SCORES_TREE 1
typedef int32_t vmask __attribute__((vector_size(VL * 4)));
/* Level s pairs vectors 2i and 2i + 1 into i: from each, the lanes of chunks of c = VL >> (s +
 * 1) at even (LO) or odd (HI) places, so a lane of the sum holds two partial sums of one key. */
#if VL == 16
static const vmask TREE_LO[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
static const vmask TREE_HI[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
    {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
#else
static const vmask TREE_LO[3] = {
    {0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
static const vmask TREE_HI[3] = {
    {4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};
#endif
/* Vectors a (earlier) and b of tree level s added into one of level s + 1 */
static inline __attribute__((always_inline)) vf tree_pair(vf a, vf b, int s) {
    return __builtin_shuffle(a, b, TREE_LO[s]) + __builtin_shuffle(a, b, TREE_HI[s]);
}

/* A block's n scores (key i in lane i) to out: stored whole where the block is full (a call of
 * memcpy per query and block, and its reload of the buffer, cost much of a query's scores on
 * AVX2) */
static inline __attribute__((always_inline)) void put_scores(float *out, vf s, int64_t n) {
    if (n == VL) {
        storev(out, s);
        return;
    }
    float buf[VL];
    storev(buf, s);
    memcpy(out, buf, n * sizeof(float));
}

#if VL == 8 && defined(__AVX2__)
#define SCORES_AVX2 1
/* tree_pair's sums with in-lane shuffles (GCC made levels 1 and 2 of its shuffles into
 * lane-crossing permutes and blends): every lane adds the same two values as there, only the
 * lanes lie elsewhere, keys 0 2 4 6 1 3 5 7 at the last level */
static inline __attribute__((always_inline)) vf tree_pair8(vf a, vf b, int s) {
    const __m256 x = (__m256)a, y = (__m256)b;
    if (s == 0)
        return (vf)_mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                                 _mm256_permute2f128_ps(x, y, 0x31));
    if (s == 1)
        return (vf)_mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))));
    return (vf)_mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* NQ queries q[0..NQ) of one KV head over one block: each key's slices are loaded (and
 * widened) once for all of them; query a's products with key i sum chunk by chunk into one
 * vector, whose lanes the tree then adds up, so every score is what the query alone would get.
 * The tree is added as keys arrive (key i's vector pairs with the one waiting at each level
 * while i's low bits are 1): a query keeps one vector per level, not one per key, which stay
 * in registers. out[a][i] = scale * q[a] . key i for i < n[a]. */
static inline __attribute__((always_inline)) void scores_block(const float *const *q, int NQ,
                                                               const void *keys, int64_t nmax,
                                                               const int64_t *n, int64_t D,
                                                               int bf16, float scale,
                                                               float *const *out) {
    enum { LEVELS = VL == 16 ? 4 : 3 };
#ifdef SCORES_AVX2
    /* AVX2's 16 registers cannot hold a key's slices beside every query's waiting vectors
     * (the spills were most of the scores' instructions): the block's keys are widened once
     * into L1, then each query takes them one by one, the same products and tree */
    float kb[VL * D];
    for (int i = 0; i < VL; i++) {
        const int64_t at = (i < nmax ? i : 0) * D;   /* a missing key reads key 0, dropped */
        for (int64_t c = 0; c < D; c += VL) storev(kb + i * D + c, load_kv(keys, at + c, bf16));
    }
    for (int a = 0; a < NQ; a++) {
        vf wait[LEVELS + 1];
#pragma GCC unroll 8
        for (int i = 0; i < VL; i++) {
            const float *k = kb + i * D;
            vf v = loadv(q[a]) * loadv(k);
            for (int64_t c = VL; c < D; c += VL) v = fma_v(loadv(q[a] + c), loadv(k + c), v);
            int s = 0;
#pragma GCC unroll 4
            for (int b = i; b & 1; b >>= 1, s++) v = tree_pair8(wait[s], v, s);
            wait[s] = v;
        }
        put_scores(out[a], (vf)_mm256_permutevar8x32_ps(                  /* key i to lane i */
                               (__m256)wait[LEVELS], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
                           * scale, n[a]);
    }
#else
    vf wait[8][LEVELS + 1];                    /* wait[a][s]: query a's level-s vector */
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++) {
        const int64_t at = (i < nmax ? i : 0) * D;   /* a missing key reads key 0, dropped */
        vf k[1024 / VL];
        for (int64_t c = 0; c < D; c += VL) k[c / VL] = load_kv(keys, at + c, bf16);
        for (int a = 0; a < NQ; a++) {
            vf v = loadv(q[a]) * k[0];
            for (int64_t c = VL; c < D; c += VL) v = fma_v(loadv(q[a] + c), k[c / VL], v);
            int s = 0;
#pragma GCC unroll 4
            for (int b = i; b & 1; b >>= 1, s++) v = tree_pair(wait[a][s], v, s);
            wait[a][s] = v;
        }
    }
    for (int a = 0; a < NQ; a++)                                        /* key i in lane i */
        put_scores(out[a], wait[a][LEVELS] * scale, n[a]);
#endif
}
#else
#define SCORES_TREE 0
#endif

/* out[a][i] = scale * q[a] . k[i] for nq queries q[a] (nq <= 8) and the first n[a] <= 16 of
 * the nmax = max n[a] keys k[i] at element i * D of keys */
static void scores(const float *const *q, int64_t nq, const void *keys, int64_t nmax,
                   const int64_t *n, int64_t D, int bf16, float scale, float *const *out) {
#if SCORES_TREE
    if (D % VL == 0 && D <= 1024) {     /* branches on bf16 and nq outside the loop: the
                                         * products fuse and the query loop unrolls */
/* the usual head widths as constants: a key's slices then stay in registers */
#define SB(NQ, BF) case NQ * 2 + BF: { \
        const char *kb = (const char *)keys + i * D * (BF ? 2 : 4); \
        if (D == 64) scores_block(q, NQ, kb, m, nn, 64, BF, scale, o); \
        else if (D == 128) scores_block(q, NQ, kb, m, nn, 128, BF, scale, o); \
        else scores_block(q, NQ, kb, m, nn, D, BF, scale, o); \
        break; }
#define SB2(NQ) SB(NQ, 0) SB(NQ, 1)
        for (int64_t i = 0; i < nmax; i += VL) {
            const int64_t m = nmax - i < VL ? nmax - i : VL;
            int64_t nn[8];
            float *o[8];
            for (int64_t a = 0; a < nq; a++) {
                nn[a] = n[a] - i < 0 ? 0 : n[a] - i < VL ? n[a] - i : VL;
                o[a] = out[a] + i;
            }
            switch (nq * 2 + bf16) { SB2(1) SB2(2) SB2(3) SB2(4) SB2(5) SB2(6) SB2(7) SB2(8) }
        }
        return;
#undef SB2
#undef SB
    }
#endif
    for (int64_t a = 0; a < nq; a++)
        for (int64_t i = 0; i < n[a]; i++) {
            if (!bf16) {
                out[a][i] = dot(q[a], (const float *)keys + i * D, D) * scale;
                continue;
            }
            vf acc = {0};       /* bfloat16 keys: dot()'s order with one accumulator */
            int64_t c = 0;
            for (; c + VL <= D; c += VL)
                acc = fma_v(loadv(q[a] + c), load_kv(keys, i * D + c, 1), acc);
            float r = hsum(acc);
            for (; c < D; c++) r = fma_s(q[a][c], kv_at(keys, i * D + c, 1), r);
            out[a][i] = r * scale;
        }
}

/* A layer's weights, in the order binding.py passes them (NULL where a layer has none). */
enum { IN_NORM, QKV_W, QKV_B, Q_NORM, K_NORM, O_W, POST_NORM, GATE_UP_W, DOWN_W, NUM_PTRS };

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t attn_in;        /* width of the attention input (EAGLE-3: 2 * hidden) */
    int64_t max_len;        /* KV positions per slot */
    int64_t mode;           /* how the four weight matrices are packed: F32 .. Q8 */
    int64_t rot_stride;     /* floats from one row's cos (or sin) to the next row's */
    int64_t kv_bf16;        /* 1: the KV cache holds bfloat16 (rounded to nearest even) */
    float eps, scale;
} Shape;

/* One row's keys and values of NKV heads (k, v: [NKV, D]) at position pos of slot `slot` of
 * k_cache, v_cache [num_slots, NKV, max_len, D] (bfloat16 when bf16). */
static void store_kv(void *k_cache, void *v_cache, int64_t slot, int64_t pos, int64_t NKV,
                     int64_t max_len, int64_t D, const float *k, const float *v, int bf16) {
    for (int64_t g = 0; g < NKV; g++) {
        const int64_t at = ((slot * NKV + g) * max_len + pos) * D;
        if (bf16) {
            uint16_t *kd = (uint16_t *)k_cache + at, *vd = (uint16_t *)v_cache + at;
            for (int64_t d = 0; d < D; d++) {
                kd[d] = (uint16_t)bf16_bits(k[g * D + d]);
                vd[d] = (uint16_t)bf16_bits(v[g * D + d]);
            }
        } else {
            memcpy((float *)k_cache + at, k + g * D, D * sizeof(float));
            memcpy((float *)v_cache + at, v + g * D, D * sizeof(float));
        }
    }
}

/* The attention half of a decoder layer over the residual stream x [T, hidden]: out (+)=
 * o_proj(attention(q, k, v)) [T, hidden], added to out when `accumulate`, else written (a
 * tensor-parallel shard's partial sum). The attention input is attn_in [T, s->attn_in] when
 * given (EAGLE-3 builds it from two inputs), else x normed by IN_NORM (or x itself when IN_NORM
 * is NULL: EAGLE-1). Row t is the token at position positions[t] of the request in KV slot
 * slots[t], rotated by cos/sin rows t (head_dim each, rot_stride apart); its keys and values
 * are written there and it attends to positions 0..positions[t] of that slot (a request's rows
 * are consecutive positions, so this is causal), or, given `mask` (draft-tree nodes, DFlash's
 * non-causal block), to the positions < mask_stride where mask[t * mask_stride + position] is
 * nonzero. k_cache, v_cache: [num_slots, num_kv_heads, max_len, head_dim]. Returns 0, or -1
 * when out of memory. */
static int attention_half(const Shape *s, int64_t T, const float *x, const float *attn_in,
                          const int64_t *slots, const int64_t *positions, const void *const *w,
                          void *k_cache, void *v_cache, const float *cos, const float *sin,
                          const uint8_t *mask, int64_t mask_stride, float *out, int accumulate,
                          int nthreads) {
    const int64_t H = s->hidden, NH = s->num_heads, NKV = s->num_kv_heads, D = s->head_dim;
    const int64_t QKV = (NH + 2 * NKV) * D, group = NH / NKV;
    const int64_t slot_stride = NKV * s->max_len * D;
    const int mode = (int)s->mode, bf16 = (int)s->kv_bf16;
    const int64_t esize = bf16 ? 2 : 4;
    if (D > 1024) return -1;
    float *h = malloc(sizeof(float) * T * H);
    float *wide = malloc(sizeof(float) * T * QKV);
    float *attn = malloc(sizeof(float) * T * NH * D);
    int64_t *run = malloc(sizeof(int64_t) * (2 * T + 1)), nruns = 0;
    if (!h || !wide || !attn || !run) {
        free(h); free(wide); free(attn); free(run);
        return -1;
    }
    const float *a_in = x;
    if (attn_in) {
        a_in = attn_in;
    } else if (w[IN_NORM]) {
        rms_norm(x, w[IN_NORM], s->eps, T, H, H, H, h);
        a_in = h;
    }
    const int64_t a_width = attn_in ? s->attn_in : H;
    int failed = specserve_linear(a_in, T, w[QKV_W], mode, w[QKV_B], QKV, a_width, wide, QKV, 0,
                                  nthreads);
    for (int64_t t = 0; !failed && t < T; t++) {
        float *q = wide + t * QKV, *k = q + NH * D, *v = k + NKV * D;
        if (w[Q_NORM]) {
            rms_norm(q, w[Q_NORM], s->eps, NH, D, D, D, q);
            rms_norm(k, w[K_NORM], s->eps, NKV, D, D, D, k);
        }
        const float *c = cos + t * s->rot_stride, *sn = sin + t * s->rot_stride;
        for (int64_t j = 0; j < NH + NKV; j++) rotary(q + j * D, c, sn, D);
        store_kv(k_cache, v_cache, slots[t], positions[t], NKV, s->max_len, D, k, v, bf16);
    }
    /* Attention, one work item per (run of rows of one request, KV head): the item's queries
     * (its rows times the query heads sharing the KV head) read each block of 16 keys once,
     * up to 8 queries from one load of it (`scores`). */
    int64_t *lens = run + T + 1;                        /* keys row t may see */
    for (int64_t t = 0; t < T; t++) lens[t] = mask ? mask_stride : positions[t] + 1;
    for (int64_t t = 0; !failed && t < T; t++)
        if (t == 0 || slots[t] != slots[t - 1] || positions[t] != positions[t - 1] + 1)
            run[nruns++] = t;
    run[nruns] = T;
    if (nruns * NKV < 2 * nthreads) {
        /* too few items for the threads (one request gives as many as KV heads: 3 on 2
         * threads leave one idle a third of the time): each run in two halves, whose queries
         * are the same sums as before */
        int64_t extra = 0, w, b = T;
        for (int64_t i = 0; i < nruns; i++) extra += run[i + 1] - run[i] >= 2;
        w = nruns + extra;
        run[w] = T;
        for (int64_t i = nruns - 1; i >= 0; i--) {      /* backwards, in place */
            const int64_t a = run[i];
            if (b - a >= 2) run[--w] = a + (b - a + 1) / 2;
            run[--w] = a;
            b = a;
        }
        nruns += extra;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic)
    for (int64_t item = 0; item < nruns * NKV; item++) {
        const int64_t t0 = run[item / NKV], t1 = run[item / NKV + 1], g = item % NKV;
        const int64_t Lmax = lens[t1 - 1];                /* lens rise within a run */
        const int64_t base = slots[t0] * slot_stride + g * s->max_len * D;
        const char *kc = (const char *)k_cache + base * esize;
        const char *vc = (const char *)v_cache + base * esize;
        const int64_t nq = (t1 - t0) * group;           /* query r: head a = r % group of */
        float *p = malloc(sizeof(float) * nq * (Lmax + 1));   /* row t0 + r / group */
        const float **qv = malloc(sizeof(float *) * nq);
        int64_t *qlen = malloc(sizeof(int64_t) * nq);
        if (!p || !qv || !qlen) {
            free(p); free(qv); free(qlen);
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *inv = p + nq * Lmax;
        /* each query's vector and key count, found once: a division per query and block of
         * keys cost as much as the block's products */
        for (int64_t r = 0; r < nq; r++) {
            const int64_t t = t0 + r / group;
            qv[r] = wide + t * QKV + (g * group + r % group) * D;
            qlen[r] = lens[t];
        }
        /* a block of 16 keys at a time for up to 8 queries at a time */
        for (int64_t j0 = 0; j0 < Lmax; j0 += 16)
            for (int64_t r0 = 0; r0 < nq; r0 += 8) {
                const int64_t nr = nq - r0 < 8 ? nq - r0 : 8;
                float *outs[8];
                int64_t n[8], nmax = 0;
                for (int64_t a = 0; a < nr; a++) {
                    const int64_t L = qlen[r0 + a];
                    n[a] = L - j0 <= 0 ? 0 : L - j0 < 16 ? L - j0 : 16;
                    nmax = n[a] > nmax ? n[a] : nmax;
                    outs[a] = p + (r0 + a) * Lmax + j0;
                }
                if (nmax > 0)
                    scores(qv + r0, nr, kc + j0 * D * esize, nmax, n, D, bf16, s->scale, outs);
            }
        for (int64_t r = 0; r < nq; r++) {
            const int64_t t = t0 + r / group;
            inv[r] = 1.f / softmax_weights(p + r * Lmax, qlen[r],
                                           mask ? mask + t * mask_stride : NULL);
        }
        weighted_sums(p, Lmax, nq, group, lens + t0, vc, D, bf16, inv,
                      attn + t0 * NH * D + g * group * D, NH * D);
        free(p); free(qv); free(qlen);
    }
    failed = failed || specserve_linear(attn, T, w[O_W], mode, NULL, H, NH * D, out, H,
                                        accumulate, nthreads);
    free(h); free(wide); free(attn); free(run);
    return failed ? -1 : 0;
}

/* The MLP half of a decoder layer over x [T, hidden]: out (+)= down(silu(gate) * up) of
 * POST_NORM(x), added when `accumulate`, else written. Returns 0, or -1 when out of memory. */
static int mlp_half(const Shape *s, int64_t T, const float *x, const void *const *w, float *out,
                    int accumulate, int nthreads) {
    const int64_t H = s->hidden, I = s->intermediate;
    const int mode = (int)s->mode;
    float *h = malloc(sizeof(float) * T * H);
    float *wide = malloc(sizeof(float) * T * 2 * I);
    float *act = malloc(sizeof(float) * T * I);
    int failed = !h || !wide || !act;
    if (!failed) {
        rms_norm(x, w[POST_NORM], s->eps, T, H, H, H, h);
        failed = specserve_linear(h, T, w[GATE_UP_W], mode, NULL, 2 * I, H, wide, 2 * I, 0,
                                  nthreads);
    }
    if (!failed) {
        for (int64_t t = 0; t < T; t++) {          /* act = silu(gate) * up */
            const float *gate = wide + t * 2 * I, *up = gate + I;
            float *a = act + t * I;
            for (int64_t i = 0; i < I; i++) a[i] = -gate[i];
            exp_array(a, a, I);
            for (int64_t i = 0; i < I; i++) a[i] = gate[i] / (1.f + a[i]) * up[i];
        }
        failed = specserve_linear(act, T, w[DOWN_W], mode, NULL, H, I, out, H, accumulate,
                                  nthreads);
    }
    free(h); free(wide); free(act);
    return failed ? -1 : 0;
}

/* One decoder layer on the residual stream x [T, hidden], in place: both halves above, each
 * added to x. Returns 0, or -1 when out of memory. */
static int layer_impl(const Shape *s, int64_t T, float *x, const float *attn_in,
                      const int64_t *slots, const int64_t *positions, const void *const *w,
                      void *k_cache, void *v_cache, const float *cos, const float *sin,
                      const uint8_t *mask, int64_t mask_stride, int nthreads) {
    if (attention_half(s, T, x, attn_in, slots, positions, w, k_cache, v_cache, cos, sin, mask,
                       mask_stride, x, 1, nthreads))
        return -1;
    return mlp_half(s, T, x, w, x, 1, nthreads);
}

/* specserve_layer's arguments by name (binding.py mirrors them). */
typedef struct {
    const Shape *s;
    int64_t T;
    float *x;
    const float *attn_in;
    const int64_t *slots;
    const int64_t *positions;
    const void *const *w;
    void *k_cache;
    void *v_cache;
    const float *cos;
    const float *sin;
    const uint8_t *mask;
    int64_t mask_stride;
    int64_t half;       /* 0: the whole layer on x; 1, 2: its attention or MLP half into out */
    float *out;         /* [T, hidden] the half's output (a tensor-parallel partial sum) */
    int nthreads;
} LayerArgs;

size_t specserve_layer_args_size(void) { return sizeof(LayerArgs); }

int specserve_layer(const LayerArgs *a) {
    if (a->half < 0 || a->half > 2 || (a->half && !a->out)) return -2;
    if (a->half == 2) return mlp_half(a->s, a->T, a->x, a->w, a->out, 0, a->nthreads);
    for (int64_t t = 0; t < a->T; t++)
        if (a->positions[t] < 0 || a->positions[t] >= a->s->max_len) return -2;
    if (a->half == 1)
        return attention_half(a->s, a->T, a->x, a->attn_in, a->slots, a->positions, a->w,
                              a->k_cache, a->v_cache, a->cos, a->sin, a->mask, a->mask_stride,
                              a->out, 0, a->nthreads);
    return layer_impl(a->s, a->T, a->x, a->attn_in, a->slots, a->positions, a->w, a->k_cache,
                      a->v_cache, a->cos, a->sin, a->mask, a->mask_stride, a->nthreads);
}

/* specserve_write_kv's arguments by name (binding.py mirrors them). */
typedef struct {
    const float *kv;            /* [T, L, 2, NKV, D]: each layer's keys, then its values */
    int64_t T, L, NKV, D, max_len;
    const float *k_norm;        /* [L, D] per-head key norm weights, or NULL */
    float eps;
    const float *cos_sin;       /* [max_len, 2, D] */
    const int64_t *slots, *positions;
    void *const *k_cache;       /* L caches [num_slots, NKV, max_len, D] */
    void *const *v_cache;
    int kv_bf16;
} WriteKVArgs;

size_t specserve_write_kv_args_size(void) { return sizeof(WriteKVArgs); }

/* Keys and values made outside a layer's step, written to the caches of L layers as that
 * layer's step writes its own rows (keys normed when k_norm is given, then rotated at their
 * position): DFlash's context, every drafter layer's keys and values of the target's
 * features from one stacked product. Returns 0, -1 when out of memory, -2 for a position
 * outside the caches or a head wider than 1024. */
int specserve_write_kv(const WriteKVArgs *a) {
    const int64_t NKV = a->NKV, D = a->D, L = a->L;
    if (D > 1024) return -2;
    for (int64_t t = 0; t < a->T; t++)
        if (a->positions[t] < 0 || a->positions[t] >= a->max_len) return -2;
    float *k = malloc(sizeof(float) * NKV * D);
    if (!k) return -1;
    for (int64_t t = 0; t < a->T; t++) {
        const float *c = a->cos_sin + a->positions[t] * 2 * D;
        for (int64_t l = 0; l < L; l++) {
            const float *row = a->kv + (t * L + l) * 2 * NKV * D;
            if (a->k_norm) rms_norm(row, a->k_norm + l * D, a->eps, NKV, D, D, D, k);
            else memcpy(k, row, sizeof(float) * NKV * D);
            for (int64_t g = 0; g < NKV; g++) rotary(k + g * D, c, c + D, D);
            store_kv(a->k_cache[l], a->v_cache[l], a->slots[t], a->positions[t], NKV,
                     a->max_len, D, k, row + NKV * D, a->kv_bf16);
        }
    }
    free(k);
    return 0;
}

/* Index of the first largest of x[0..n-1]; a NaN counts as largest, as in torch.argmax. */
static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

/* The greedy next token of each of B rows x [B, H]: the first largest logit of
 * lm_head(final_norm(x)) (lm_head(x) when final_norm is NULL) over `vocab` ids, plus d2t[id]
 * when d2t is given, into out[B]; with prob, also its probability under the softmax of those
 * logits into prob[B]. Returns 0, or -1 when out of memory.
 * Scratch: normed [B, H], logits [B, vocab]. */
static int greedy_rows(const float *x, int64_t B, int64_t H, const float *final_norm, float eps,
                       const void *lm_head, int lm_mode, int64_t vocab, const int64_t *d2t,
                       float *normed, float *logits, int64_t *out, float *prob, int nthreads) {
    if (final_norm) rms_norm(x, final_norm, eps, B, H, H, H, normed);
    if (specserve_linear(final_norm ? normed : x, B, lm_head, lm_mode, NULL, vocab, H, logits,
                         vocab, 0, nthreads))
        return -1;
    for (int64_t b = 0; b < B; b++) {
        float *row = logits + b * vocab;
        const int64_t id = argmax(row, vocab);
        out[b] = id + (d2t ? d2t[id] : 0);
        if (prob) {             /* 1 / sum_i exp(l_i - l_max) */
            const float top = row[id];
            for (int64_t i = 0; i < vocab; i++) row[i] -= top;
            exp_array(row, row, vocab);
            double sum = 0;
            for (int64_t i = 0; i < vocab; i++) sum += row[i];
            prob[b] = (float)(1.0 / sum);
        }
    }
    return 0;
}

/* Greedy chains with a confidence threshold: a request whose drafter gave its j-th draft
 * (0-based) a probability below `threshold` stops there (budget[b] = j + 1; the draft is kept). */
static void stop_unsure(const int64_t *rows, int64_t m, const float *prob, float threshold,
                        int64_t j, int64_t *budget) {
    if (prob)
        for (int64_t k = 0; k < m; k++)
            if (prob[k] < threshold && budget[rows[k]] > j + 1) budget[rows[k]] = j + 1;
}

/* Keeps the rows rows[0..m-1] (request indices) whose budget exceeds `drafted`, in order,
 * moving their state rows (H floats each) and tokens along where given; returns how many. */
static int64_t keep_rows(int64_t *rows, int64_t m, const int64_t *budget, int64_t drafted,
                         float *state, int64_t H, int64_t *tok) {
    int64_t kept = 0;
    for (int64_t k = 0; k < m; k++)
        if (budget[rows[k]] > drafted) {
            if (state && kept != k) memmove(state + kept * H, state + k * H, H * sizeof(float));
            if (tok) tok[kept] = tok[k];
            rows[kept++] = rows[k];
        }
    return kept;
}

/* Slots, positions (pos0[row] + offset) and rotary rows (cos then sin, 2 * D floats apart)
 * of the m rows `rows`. */
static void row_inputs(const int64_t *rows, int64_t m, const int64_t *slots, const int64_t *pos0,
                       int64_t offset, const float *cos_sin, int64_t D, int64_t *slot,
                       int64_t *pos, float *rot) {
    for (int64_t k = 0; k < m; k++) {
        slot[k] = slots[rows[k]];
        pos[k] = pos0[rows[k]] + offset;
        memcpy(rot + k * 2 * D, cos_sin + pos[k] * 2 * D, 2 * D * sizeof(float));
    }
}

/* Chain drafting in one call, instead of a dozen operator launches from Python per pass (more
 * than a small drafter's weights cost at batch 1). Request b drafts budget[b] <= n greedy
 * tokens into tokens[b * n ...]; pass j runs the requests that still draft, so none writes KV
 * past its budget. With threshold > 0 a request stops after its first draft of lower
 * probability (stop_unsure), and budget[b] is left at the number it drafted. Each computes op
 * for op what the PyTorch loop does through this kernel (the head's greedy_tokens and forward;
 * the model's forward and compute_logits), so the drafts equal that loop's. cos_sin: the
 * rotary table [positions, 2, head_dim]. Return 0, or -1 when out of memory. */

/* The pass of a head that drafts from its own state (EAGLE-1, EAGLE-3, MTP) over m rows of
 * (token tok[k], state x[k]) at positions pos[k] of KV slots slot[k]: with cat = [e_norm(
 * embed[tok]); h_norm(x)] (a NULL norm copies its half), the head's layer (weights w, shape ls)
 * runs over x = fc(cat) + fc_bias (EAGLE-1, MTP; fc_bias may be NULL), or, with fc NULL, with
 * cat as the attention input and x as residual (EAGLE-3); x [m, H] becomes its output.
 * Scratch: cat [m, 2H]. */
static int head_rows(const Shape *ls, int64_t m, const int64_t *tok, float *x,
                     const int64_t *slot, const int64_t *pos, const float *rot,
                     const float *embed, const float *e_norm, const float *h_norm,
                     const void *fc, int fc_mode, const float *fc_bias, const void *const *w,
                     void *k_cache, void *v_cache, float *cat, int nthreads) {
    const int64_t H = ls->hidden;
    for (int64_t k = 0; k < m; k++) {
        float *e = cat + k * 2 * H, *h = e + H;
        if (e_norm) rms_norm(embed + tok[k] * H, e_norm, ls->eps, 1, H, H, H, e);
        else memcpy(e, embed + tok[k] * H, H * sizeof(float));
        if (h_norm) rms_norm(x + k * H, h_norm, ls->eps, 1, H, H, H, h);
        else memcpy(h, x + k * H, H * sizeof(float));
    }
    if (fc && specserve_linear(cat, m, fc, fc_mode, fc_bias, H, 2 * H, x, H, 0, nthreads))
        return -1;
    return layer_impl(ls, m, x, fc ? NULL : cat, slot, pos, w, k_cache, v_cache, rot,
                           rot + ls->head_dim, NULL, 0, nthreads);
}

/* A head's chain (head_rows), after ingesting the T rows the target verified since the last
 * step: (token in_tok[t], target feature in_h[t]) at position in_pos[t] of slot in_slot[t], the
 * rows of each request in order; in_h [T, H] is overwritten and the state of request b is the
 * ingest output at row last[b]. With T = 0 the caller gives the state. Pass j drafts token j
 * from state[b] by greedy_rows (final_norm NULL for EAGLE-1; d2t for EAGLE-3's draft
 * vocabulary); while the request drafts on, head_rows feeds (token j, state) at position
 * pos0[b] + j of slot slots[b] and its output is the next state. state [B, H] is overwritten. */
static int head_chain(const Shape *s, int64_t T, const int64_t *in_tok, float *in_h,
                      const int64_t *in_slot, const int64_t *in_pos, const int64_t *last,
                      int64_t B, int64_t n, float *state,
                      const int64_t *slots, const int64_t *pos0, int64_t *budget,
                      float threshold, const float *embed, const float *e_norm,
                      const float *h_norm, const void *fc, int fc_mode, const float *fc_bias,
                      const float *final_norm, const void *lm_head, int lm_mode,
                      int64_t vocab, const int64_t *d2t, const float *cos_sin,
                      const void *const *w, void *k_cache, void *v_cache, int64_t *tokens,
                      int nthreads) {
    const int64_t H = s->hidden, D = s->head_dim, R = T > B ? T : B;
    Shape ls = *s;
    ls.rot_stride = 2 * D;
    float *normed = malloc(sizeof(float) * B * H), *logits = malloc(sizeof(float) * B * vocab);
    float *cat = malloc(sizeof(float) * R * 2 * H), *rot = malloc(sizeof(float) * R * 2 * D);
    float *prob = threshold > 0 ? malloc(sizeof(float) * B) : NULL;
    int64_t *ints = malloc(sizeof(int64_t) * B * 4);
    int rc = normed && logits && cat && rot && ints && (prob || threshold <= 0) ? 0 : -1;
    int64_t *rows = ints, *slot = ints + B, *pos = ints + 2 * B, *tok = ints + 3 * B, m = B;
    if (rc == 0 && T > 0) {
        for (int64_t t = 0; t < T; t++)
            memcpy(rot + t * 2 * D, cos_sin + in_pos[t] * 2 * D, 2 * D * sizeof(float));
        rc = head_rows(&ls, T, in_tok, in_h, in_slot, in_pos, rot, embed, e_norm, h_norm, fc,
                       fc_mode, fc_bias, w, k_cache, v_cache, cat, nthreads);
        for (int64_t b = 0; rc == 0 && b < B; b++)
            memcpy(state + b * H, in_h + last[b] * H, H * sizeof(float));
    }
    for (int64_t b = 0; b < B; b++) rows[b] = b;
    m = rc == 0 ? keep_rows(rows, m, budget, 0, state, H, NULL) : 0;
    for (int64_t j = 0; rc == 0 && m > 0; j++) {
        if ((rc = greedy_rows(state, m, H, final_norm, s->eps, lm_head, lm_mode, vocab, d2t,
                              normed, logits, tok, prob, nthreads)))
            break;
        for (int64_t k = 0; k < m; k++) tokens[rows[k] * n + j] = tok[k];
        stop_unsure(rows, m, prob, threshold, j, budget);
        if ((m = keep_rows(rows, m, budget, j + 1, state, H, tok)) == 0) break;
        row_inputs(rows, m, slots, pos0, j, cos_sin, D, slot, pos, rot);
        rc = head_rows(&ls, m, tok, state, slot, pos, rot, embed, e_norm, h_norm, fc, fc_mode,
                       fc_bias, w, k_cache, v_cache, cat, nthreads);
    }
    free(normed); free(logits); free(cat); free(rot); free(prob); free(ints);
    return rc;
}

/* specserve_head_chain's arguments by name (binding.py mirrors it; it checks the size
 * against specserve_head_chain_args_size at load, so a mismatched copy fails there, not in
 * memory). */
typedef struct {
    const Shape *s;
    int64_t T;                  /* rows to ingest first (0: none) */
    const int64_t *in_tok, *in_slot, *in_pos, *last;
    float *in_h;
    int64_t B, n;               /* drafting requests, most drafts per request */
    float *state;
    const int64_t *slots, *pos0;
    int64_t *budget;
    float threshold;
    const float *embed, *e_norm, *h_norm;
    const void *fc;
    int fc_mode;
    const float *fc_bias, *final_norm;
    const void *lm_head;
    int lm_mode;
    int64_t vocab;
    const int64_t *d2t;
    const float *cos_sin;
    const void *const *w;
    void *k_cache, *v_cache;
    int64_t *tokens;
    int nthreads;
} HeadChainArgs;

size_t specserve_head_chain_args_size(void) { return sizeof(HeadChainArgs); }

/* The head's chain (see head_chain). Returns -1 when out of memory, -2 when an ingest row or
 * a draft would be written outside the KV cache's positions (s->max_len). */
int specserve_head_chain(const HeadChainArgs *a) {
    const int64_t L = a->s->max_len;
    for (int64_t t = 0; t < a->T; t++)
        if (a->in_pos[t] < 0 || a->in_pos[t] >= L) return -2;
    for (int64_t b = 0; b < a->B; b++)
        if ((a->T > 0 && (a->last[b] < 0 || a->last[b] >= a->T)) || a->pos0[b] < 0
            || a->budget[b] < 0 || a->budget[b] > a->n || a->pos0[b] + a->budget[b] - 1 > L)
            return -2;
    return head_chain(a->s, a->T, a->in_tok, a->in_h, a->in_slot, a->in_pos, a->last, a->B,
                      a->n, a->state, a->slots, a->pos0, a->budget, a->threshold, a->embed,
                      a->e_norm, a->h_norm, a->fc, a->fc_mode, a->fc_bias, a->final_norm,
                      a->lm_head, a->lm_mode, a->vocab, a->d2t, a->cos_sin, a->w, a->k_cache,
                      a->v_cache, a->tokens, a->nthreads);
}

/* specserve_llama_chain's arguments by name (binding.py mirrors them). */
typedef struct {
    const Shape *s;
    int64_t L;
    int64_t T;                  /* rows to ingest first (0: none) */
    const int64_t *in_tok, *in_slot, *in_pos, *last;
    int64_t B;
    int64_t n;
    const int64_t *slots;
    const int64_t *pos0;
    int64_t *budget;
    float threshold;
    const float *embed;
    const float *final_norm;
    const void *lm_head;
    int lm_mode;
    int64_t vocab;
    const float *cos_sin;
    const void *const *const *w;
    void *const *k_cache;
    void *const *v_cache;
    int64_t *tokens;
    int nthreads;
} LlamaChainArgs;

size_t specserve_llama_chain_args_size(void) { return sizeof(LlamaChainArgs); }

/* The draft model's L layers (shapes ls[l]) over the m rows x [m, H], in place, at positions
 * pos of KV slots slot with rotary rows rot. */
static int llama_layers(const LlamaChainArgs *a, const Shape *ls, int64_t m, float *x,
                        const int64_t *slot, const int64_t *pos, const float *rot) {
    int rc = 0;
    for (int64_t l = 0; rc == 0 && l < a->L; l++)
        rc = layer_impl(&ls[l], m, x, NULL, slot, pos, a->w[l], a->k_cache[l], a->v_cache[l],
                        rot, rot + ls[l].head_dim, NULL, 0, a->nthreads);
    return rc;
}

/* Draft j of the m requests rows[k] from their layer outputs x [m, H]: greedy_rows with
 * final_norm and lm_head into tokens[rows[k] * n + j], then stop_unsure. Scratch: normed
 * [m, H], logits [m, vocab], tok [m], prob [m] (NULL without a threshold). */
static int llama_draft(const LlamaChainArgs *a, int64_t m, const int64_t *rows, int64_t j,
                       const float *x, float *normed, float *logits, int64_t *tok,
                       float *prob) {
    int rc = greedy_rows(x, m, a->s[0].hidden, a->final_norm, a->s[0].eps, a->lm_head,
                         a->lm_mode, a->vocab, NULL, normed, logits, tok, prob, a->nthreads);
    if (rc == 0) {
        for (int64_t k = 0; k < m; k++) a->tokens[rows[k] * a->n + j] = tok[k];
        stop_unsure(rows, m, prob, a->threshold, j, a->budget);
    }
    return rc;
}

/* A whole decoder (a draft model) drafting greedy chains: with T > 0 it first ingests the rows
 * the draft has not seen (token in_tok[t] at position in_pos[t] of slot in_slot[t], each
 * request's rows in order: the catch-up pass, and PARD's mask rows after them), and draft 0
 * of request b comes from row last[b]; with T = 0 tokens[b * n] holds it. Pass j = 1, 2, ...
 * feeds token j-1 of the requests that draft a j-th at position pos0[b] + j - 1 of slot
 * slots[b] through embed and the L layers (shapes s[l], weights w[l], caches k[l], v[l]) and
 * drafts token j. */
static int llama_chain_impl(const LlamaChainArgs *a) {
    const Shape *s = a->s;
    const int64_t L = a->L, B = a->B, H = s[0].hidden, D = s[0].head_dim;
    const int64_t R = a->T > B ? a->T : B;
    Shape *ls = malloc(sizeof(Shape) * L);
    float *x = malloc(sizeof(float) * R * H), *normed = malloc(sizeof(float) * B * H);
    float *logits = malloc(sizeof(float) * B * a->vocab);
    float *rot = malloc(sizeof(float) * R * 2 * D);
    float *prob = a->threshold > 0 ? malloc(sizeof(float) * B) : NULL;
    int64_t *ints = malloc(sizeof(int64_t) * B * 4);
    int rc = ls && x && normed && logits && rot && ints && (prob || a->threshold <= 0) ? 0 : -1;
    int64_t *rows = ints, *slot = ints + B, *pos = ints + 2 * B, *tok = ints + 3 * B, m = B;
    for (int64_t l = 0; rc == 0 && l < L; l++) {
        ls[l] = s[l];
        ls[l].rot_stride = 2 * D;
    }
    for (int64_t b = 0; b < B; b++) rows[b] = b;
    if (rc == 0 && a->T > 0) {
        for (int64_t t = 0; t < a->T; t++) {
            memcpy(x + t * H, a->embed + a->in_tok[t] * H, H * sizeof(float));
            memcpy(rot + t * 2 * D, a->cos_sin + a->in_pos[t] * 2 * D, 2 * D * sizeof(float));
        }
        rc = llama_layers(a, ls, a->T, x, a->in_slot, a->in_pos, rot);
        /* the drafting rows to the front, in request order (last[] rises within a request) */
        for (int64_t b = 0; rc == 0 && b < B; b++)
            memmove(x + b * H, x + a->last[b] * H, H * sizeof(float));
        if (rc == 0) rc = llama_draft(a, B, rows, 0, x, normed, logits, tok, prob);
    }
    for (int64_t j = 1; rc == 0 && (m = keep_rows(rows, m, a->budget, j, NULL, H, NULL)) > 0;
         j++) {
        row_inputs(rows, m, a->slots, a->pos0, j - 1, a->cos_sin, D, slot, pos, rot);
        for (int64_t k = 0; k < m; k++)
            memcpy(x + k * H, a->embed + a->tokens[rows[k] * a->n + j - 1] * H,
                   H * sizeof(float));
        rc = llama_layers(a, ls, m, x, slot, pos, rot);
        if (rc == 0) rc = llama_draft(a, m, rows, j, x, normed, logits, tok, prob);
    }
    free(ls); free(x); free(normed); free(logits); free(rot); free(prob); free(ints);
    return rc;
}

/* The draft model's chain (see llama_chain_impl). Returns -1 when out of memory, -2 when an
 * ingest row or a draft would be written outside the KV cache's positions. */
int specserve_llama_chain(const LlamaChainArgs *a) {
    const int64_t L = a->s[0].max_len;
    for (int64_t t = 0; t < a->T; t++)
        if (a->in_pos[t] < 0 || a->in_pos[t] >= L) return -2;
    for (int64_t b = 0; b < a->B; b++) {
        /* drafting rows rise (llama_chain_impl moves them to the front in place) */
        if (a->T > 0 && (a->last[b] < b || a->last[b] >= a->T
                         || (b > 0 && a->last[b] <= a->last[b - 1])))
            return -2;
        if (a->pos0[b] < 0 || a->budget[b] < 0 || a->budget[b] > a->n
            || a->pos0[b] + a->budget[b] - 1 > L)
            return -2;
    }
    return llama_chain_impl(a);
}

/* The all-reduce (sum) of tensor-parallel ranks on one machine, through memory they share
 * instead of gloo's round trips over TCP, two per layer.
 * shm: counters [size, 8] int64 (rank r's parts so far at counters[8 r], a cache line each),
 * then two buffers [2, size, cap] float: part number seq uses buffer seq % 2, where rank r
 * posts its part at [r]. A rank can be at most one part ahead of the slowest (each part waits
 * for every rank's post), so the buffer it writes is never one another rank still reads. Every
 * rank sums the posts in rank order: all get the same bits. */
typedef struct {
    float *x;               /* [n] in: this rank's partial sum; out: the sum over ranks */
    int64_t n;              /* summed in parts of at most cap floats */
    int64_t *shm;
    int64_t cap, rank, size;
    int64_t seq;            /* parts summed so far */
    double timeout_s;       /* the longest wait for the other ranks in one call */
    const int32_t *peers;   /* child processes whose exit ends a wait (rank 0's workers) */
    int64_t npeers;
    int64_t parent;         /* a worker's rank 0: its exit ends a wait too (0: none) */
} AllReduceArgs;

size_t specserve_all_reduce_args_size(void) { return sizeof(AllReduceArgs); }

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* One turn of a spin-wait loop */
static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* Whether a rank this one waits for is gone: a child in a->peers that exited (looked at, not
 * reaped: its owner reaps it) or was reaped already, or a->parent no longer this process's
 * parent. */
static int peer_gone(const AllReduceArgs *a) {
#if defined(__linux__)
    if (a->parent && getppid() != (pid_t)a->parent) return 1;
    for (int64_t i = 0; i < a->npeers; i++) {
        siginfo_t info;
        info.si_pid = 0;
        const int rc = waitid(P_PID, (id_t)a->peers[i], &info, WEXITED | WNOHANG | WNOWAIT);
        if ((rc == 0 && info.si_pid) || (rc == -1 && errno == ECHILD)) return 1;
    }
#endif
    return 0;
}

/* x [n <= cap] summed over the ranks as the next part. Returns 0, or -3 when a rank is gone
 * or did not post by `deadline`. */
static int reduce_part(AllReduceArgs *a, float *x, int64_t n, double deadline) {
    const int64_t seq = ++a->seq;
    int64_t *counters = a->shm;
    float *buf = (float *)(a->shm + 8 * a->size) + (seq % 2) * a->size * a->cap;
    memcpy(buf + a->rank * a->cap, x, n * sizeof(float));
    __atomic_store_n(counters + 8 * a->rank, seq, __ATOMIC_RELEASE);
    double next_check = 0;
    for (int64_t r = 0; r < a->size; r++) {
        for (int64_t spins = 1; __atomic_load_n(counters + 8 * r, __ATOMIC_ACQUIRE) < seq;
             spins++) {
            if (spins % 64) {
                relax();
                continue;
            }
            const double now = seconds();
            if (now > deadline) return -3;
            if (now > next_check) {         /* a few system calls, every 10 ms of waiting */
                if (peer_gone(a)) return -3;
                next_check = now + 0.01;
            }
            sched_yield();      /* the rank it waits for may need this core */
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float sum = buf[i];
        for (int64_t r = 1; r < a->size; r++) sum += buf[r * a->cap + i];
        x[i] = sum;
    }
    return 0;
}

/* a->x [a->n] summed over the ranks, in place, in parts of at most a->cap. Returns 0, -2 for
 * arguments out of range, or -3 when a rank is gone or did not come within a->timeout_s (the
 * caller finds out which). */
int specserve_all_reduce(AllReduceArgs *a) {
    if (a->n < 0 || a->cap < 1 || a->rank < 0 || a->rank >= a->size) return -2;
    const double deadline = seconds() + a->timeout_s;
    for (int64_t start = 0; start < a->n; start += a->cap) {
        const int rc = reduce_part(a, a->x + start, a->n - start < a->cap ? a->n - start : a->cap,
                                   deadline);
        if (rc) return rc;
    }
    return 0;
}

/* One decoder layer of a tensor-parallel shard on x [T, hidden], in place: each half's partial
 * sum (part [T, hidden]) is summed over the ranks before it joins the stream, as CpuLayer does
 * with its reduce. */
static int sharded_layer(const Shape *s, int64_t T, float *x, const int64_t *slots,
                         const int64_t *positions, const void *const *w, void *k_cache,
                         void *v_cache, const float *cos, const float *sin, const uint8_t *mask,
                         int64_t mask_stride, AllReduceArgs *ar, float *part, int nthreads) {
    const int64_t n = T * s->hidden;
    ar->x = part;
    ar->n = n;
    int rc = attention_half(s, T, x, NULL, slots, positions, w, k_cache, v_cache, cos, sin, mask,
                            mask_stride, part, 0, nthreads);
    if (!rc) rc = specserve_all_reduce(ar);
    for (int64_t i = 0; !rc && i < n; i++) x[i] += part[i];
    if (!rc) rc = mlp_half(s, T, x, w, part, 0, nthreads);
    if (!rc) rc = specserve_all_reduce(ar);
    for (int64_t i = 0; !rc && i < n; i++) x[i] += part[i];
    return rc;
}

/* A Llama-family model's cached step of T rows in one call (a decode, verify, tree or prompt
 * step of the target, instead of a dozen PyTorch operators and a C call per layer): x =
 * embed[ids]; each of the L layers (shapes s, weights w, caches k_cache/v_cache) runs over x as
 * in specserve_layer, row t at KV position positions[t] of slot slots[t] (under `mask` for
 * tree steps) rotated by row rope[t] of cos_sin [positions, 2, head_dim]; the input of layer
 * aux_layers[a] goes to columns a * H.. of aux [T, n_aux * H]; hidden [T, H] = final_norm(x)
 * (epsilon eps). With `ar` (a tensor-parallel shard), each layer's halves are summed over the
 * ranks as they end (sharded_layer).
 * Each value is the one the layer-by-layer path computes. Returns 0, or -1 when out of memory. */
static int llama_forward_impl(const Shape *s, int64_t L, int64_t T, const int64_t *ids,
                            const int64_t *slots, const int64_t *positions, const int64_t *rope,
                            const float *embed, const float *final_norm, float eps,
                            const float *cos_sin,
                            const void *const *const *w, void *const *k_cache,
                            void *const *v_cache, const uint8_t *mask, int64_t mask_stride,
                            int64_t n_aux, const int64_t *aux_layers, float *aux, float *hidden,
                            AllReduceArgs *ar, int nthreads) {
    const int64_t H = s[0].hidden, D = s[0].head_dim;
    float *x = malloc(sizeof(float) * T * H), *rot = malloc(sizeof(float) * T * 2 * D);
    float *part = ar ? malloc(sizeof(float) * T * H) : NULL;
    int rc = x && rot && (part || !ar) ? 0 : -1;
    for (int64_t t = 0; rc == 0 && t < T; t++) {
        memcpy(x + t * H, embed + ids[t] * H, H * sizeof(float));
        memcpy(rot + t * 2 * D, cos_sin + rope[t] * 2 * D, 2 * D * sizeof(float));
    }
    for (int64_t l = 0; rc == 0 && l < L; l++) {
        for (int64_t a = 0; a < n_aux; a++)
            if (aux_layers[a] == l)
                for (int64_t t = 0; t < T; t++)
                    memcpy(aux + (t * n_aux + a) * H, x + t * H, H * sizeof(float));
        Shape ls = s[l];
        ls.rot_stride = 2 * D;
        rc = ar ? sharded_layer(&ls, T, x, slots, positions, w[l], k_cache[l], v_cache[l], rot,
                                rot + D, mask, mask_stride, ar, part, nthreads)
                : layer_impl(&ls, T, x, NULL, slots, positions, w[l], k_cache[l], v_cache[l],
                             rot, rot + D, mask, mask_stride, nthreads);
    }
    if (rc == 0) rms_norm(x, final_norm, eps, T, H, H, H, hidden);
    free(x); free(rot); free(part);
    return rc;
}

/* specserve_llama_forward's arguments by name (binding.py mirrors them). */
typedef struct {
    const Shape *s;
    int64_t L;
    int64_t T;
    const int64_t *ids;
    const int64_t *slots;
    const int64_t *positions;
    const int64_t *rope;
    const float *embed;
    const float *final_norm;
    float eps;
    const float *cos_sin;
    const void *const *const *w;
    void *const *k_cache;
    void *const *v_cache;
    const uint8_t *mask;
    int64_t mask_stride;
    int64_t n_aux;
    const int64_t *aux_layers;
    float *aux;
    float *hidden;
    AllReduceArgs *ar;          /* a tensor-parallel shard's all-reduce; NULL: a whole model */
    int nthreads;
} LlamaForwardArgs;

size_t specserve_llama_forward_args_size(void) { return sizeof(LlamaForwardArgs); }

int specserve_llama_forward(const LlamaForwardArgs *a) {
    for (int64_t t = 0; t < a->T; t++)
        if (a->positions[t] < 0 || a->positions[t] >= a->s[0].max_len) return -2;
    for (int64_t i = 0; i < a->n_aux; i++)
        if (a->aux_layers[i] < 0 || a->aux_layers[i] >= a->L) return -2;
    return llama_forward_impl(a->s, a->L, a->T, a->ids, a->slots, a->positions, a->rope, a->embed,
                              a->final_norm, a->eps, a->cos_sin, a->w, a->k_cache, a->v_cache,
                              a->mask, a->mask_stride, a->n_aux, a->aux_layers, a->aux, a->hidden,
                              a->ar, a->nthreads);
}

/* Rank 0's step messages to the tensor-parallel workers of its machine, through the same kind
 * of shared memory: the uint32 at shm is the number of messages sent (a futex word), the bytes
 * of the last one follow (written by the caller before specserve_channel_post). A waiting
 * worker spins a moment (the next step usually comes within microseconds), then sleeps on the
 * futex, so an idle server's workers use no CPU. */
typedef struct {
    uint32_t *shm;
    uint32_t seen;          /* wait: messages this rank has read (mod 2^32) */
    double timeout_s;       /* wait: return 1 after this long without a new message */
} ChannelArgs;

size_t specserve_channel_args_size(void) { return sizeof(ChannelArgs); }

int specserve_channel_post(const ChannelArgs *a) {
    __atomic_add_fetch(a->shm, 1, __ATOMIC_RELEASE);
#if defined(__linux__)
    syscall(SYS_futex, a->shm, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#endif
    return 0;
}

int specserve_channel_wait(const ChannelArgs *a) {
    const double deadline = seconds() + a->timeout_s;
    for (int64_t spins = 1; __atomic_load_n(a->shm, __ATOMIC_ACQUIRE) == a->seen; spins++) {
        if (spins % 64) {
            relax();
            continue;
        }
        const double left = deadline - seconds();
        if (left <= 0) return 1;
        if (spins < 4096) {
            sched_yield();
            continue;
        }
#if defined(__linux__)
        struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        syscall(SYS_futex, a->shm, FUTEX_WAIT, a->seen, &ts, NULL, 0);
#else
        sched_yield();
#endif
    }
    return 0;
}
