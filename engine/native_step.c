/* One greedy T5 decoder step on the CPU, float32: engine/native.py builds and calls it.
 *
 * The same arithmetic as engine/t5.py decode_steps with one query and steps = 1 (the
 * self-attention cache, the cross K/V and both biases are the runtime's own tensors),
 * in one call: every one-row product streams its weights once with several rows and
 * accumulators in flight, where inductor's generated loop keeps one accumulator per row
 * and waits on its chain of dependent adds rather than on memory
 * (docs/engine.md#the-c-decode-step, docs/benchmarks.md#benchdecode_step).
 * GCC vector extensions: AVX-512, AVX2 or SSE as -march=native allows.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One vector register: 16 floats with AVX-512, 8 with AVX/AVX2, 4 otherwise. A wider
 * vector than the machine's would be split in two, and the 4 x 2 block below would need
 * 16 accumulators: more than AVX2's 16 registers hold with the loads, and the spills
 * make the step slower than the compiled one (docs/engine.md#the-c-decode-step). */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vec __attribute__((vector_size(VW * 4), aligned(4), may_alias));

enum { ACT_RELU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2, ACT_SILU = 3 };

/* How the linear weights are stored (engine.quantization: int8 is weight-only int8 with one
 * float scale per output row, W[r, :] = q[r, :] * s[r]). */
enum { W_FLOAT = 0, W_INT8 = 1 };

typedef struct {
    int64_t layers, d_model, heads, d_kv, inner, d_ff, vocab, gated, act;
    float eps, out_scale;
    const float *embed, *lm_head, *final_ln;
    /* per layer, arrays of `layers` pointers (the linear ones unused with int8 weights) */
    const float *const *ln_att, *const *qkv, *const *o;
    const float *const *ln_cross, *const *cq, *const *co;
    const float *const *ln_ff, *const *wi, *const *wo;
    /* W_INT8: each linear weight as int8 rows (`_q`), their scales (`_s`) and their row
     * sums (`_c`: the correction for the unsigned activations of gemm_q8_dot), per layer */
    int64_t wmode;
    const int8_t *lm_head_q;
    const float *lm_head_s;
    const int32_t *lm_head_c;
    const int8_t *const *qkv_q, *const *o_q, *const *cq_q, *const *co_q, *const *wi_q,
        *const *wo_q;
    const float *const *qkv_s, *const *o_s, *const *cq_s, *const *co_s, *const *wi_s,
        *const *wo_s;
    const int32_t *const *qkv_c, *const *o_c, *const *cq_c, *const *co_c, *const *wi_c,
        *const *wo_c;
    /* W_INT8: the same weights in gemm_q8_packed's repacked layout, made once at bind
     * (engine.native: sixteen rows a block, groups of four bytes padded with zero weights to
     * whole 64-byte chunks); NULL where none were made */
    const int32_t *lm_head_p;
    const int32_t *const *qkv_p, *const *o_p, *const *cq_p, *const *co_p, *const *wi_p,
        *const *wo_p;
} Model;

#if defined(__AVX512F__)
#include <immintrin.h>
static inline float hsum(vec a) { return _mm512_reduce_add_ps((__m512)a); }
#elif defined(__AVX__)
#include <immintrin.h>
static inline float hsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
static inline float hsum(vec a) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += a[i];
    return s;
}
#endif

static inline vec load(const float *p) { return *(const vec *)p; }

/* c + a b rounded once where the machine has FMA, else rounded twice: explicit, so that every
 * loop that must give a sum bit for bit as another loop does (gemm's blockings, weigh_block's
 * numbers of queries) does, whatever the compiler would contract in each. */
#if defined(__AVX512F__)
static inline vec fmav(vec a, vec b, vec c) {
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif defined(__FMA__) && VW == 8
static inline vec fmav(vec a, vec b, vec c) {
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline vec fmav(vec a, vec b, vec c) { return c + a * b; }
#endif
/* s in every lane, bit for bit (x - +0 is x, -0 and NaN included) */
static inline vec bcast(float s) { return s - (vec){0}; }
#if defined(__FMA__)
#define FMAS(a, b, c) fmaf((a), (b), (c))
#else
#define FMAS(a, b, c) ((c) + (a) * (b))
#endif

/* hsum of four vectors at once, out[j] holding hsum(a_j) bit for bit: each vector is folded
 * to four lanes as hsum folds it (GCC's _mm512_reduce_add_ps, the AVX hsum above), then the
 * last two rounds of adds run for all four in one vector each ((x0 + x2) + (x1 + x3), hsum's
 * order). One tree for four sums costs less than four: in a product of a few hundred values
 * a row (the built-in widths) the reductions are a large part of its time. */
#if defined(__AVX512F__)
static inline __m128 fold_ps(vec a) {
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256((__m512)a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)a, 1)));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#elif defined(__AVX__)
static inline __m128 fold_ps(vec a) {
    return _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
}
#endif
static inline void hsum4(vec a, vec b, vec c, vec d, float *out) {
#if defined(__AVX__)
    const __m128 sa = fold_ps(a), sb = fold_ps(b), sc = fold_ps(c), sd = fold_ps(d);
    const __m128 ab = _mm_add_ps(_mm_unpacklo_ps(sa, sb), _mm_unpackhi_ps(sa, sb));
    const __m128 cd = _mm_add_ps(_mm_unpacklo_ps(sc, sd), _mm_unpackhi_ps(sc, sd));
    _mm_storeu_ps(out, _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab)));
#else
    out[0] = hsum(a); out[1] = hsum(b); out[2] = hsum(c); out[3] = hsum(d);
#endif
}

#if defined(__AVX512F__)
/* hsum of sixteen vectors at once, out[m] holding hsum(v[m]) bit for bit: hsum's tree (the
 * upper half of each vector added to the lower, then the upper quarter of that, then
 * (x0 + x2) + (x1 + x3)) run for all sixteen in whole registers, two vectors folded per
 * shuffle pair. Four hsum4 calls take about twice the shuffles, and shuffles share their
 * port with the FMAs, which at the built-in widths run only a few per sum. The
 * pairs of the first round are chosen so that the last round's lane k, element e is
 * v[4k + e]: out in order, stored at once. */
static inline void hsum16(const vec *v, float *out) {
    const __m512 *u = (const __m512 *)v;
#define FOLD256(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), \
                                    _mm512_shuffle_f32x4(a, b, 0xEE))
    const __m512 w0 = FOLD256(u[0], u[4]), w1 = FOLD256(u[8], u[12]);
    const __m512 w2 = FOLD256(u[1], u[5]), w3 = FOLD256(u[9], u[13]);
    const __m512 w4 = FOLD256(u[2], u[6]), w5 = FOLD256(u[10], u[14]);
    const __m512 w6 = FOLD256(u[3], u[7]), w7 = FOLD256(u[11], u[15]);
#undef FOLD256
#define FOLD128(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), \
                                    _mm512_shuffle_f32x4(a, b, 0xDD))
    const __m512 x0 = FOLD128(w0, w1), x1 = FOLD128(w2, w3);
    const __m512 x2 = FOLD128(w4, w5), x3 = FOLD128(w6, w7);
#undef FOLD128
    /* per 128-bit lane: (x0 + x2, x1 + x3) of two sums side by side, then their total */
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_ps(x0, x1, 0x44),
                                    _mm512_shuffle_ps(x0, x1, 0xEE));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_ps(x2, x3, 0x44),
                                    _mm512_shuffle_ps(x2, x3, 0xEE));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88),
                                        _mm512_shuffle_ps(z0, z1, 0xDD)));
}
#endif

/* Keep a loaded vector in a register: without this gcc folds each load into every FMA
 * that uses it (13 loads for 6 vectors per iteration of the 4 x 2 block), and the loop
 * becomes bound by the load ports instead of the FMA units. */
#if defined(__x86_64__) || defined(__i386__)
#define PIN(v) __asm__("" : "+v"(v))
#else
#define PIN(v) ((void)0)
#endif

/* x . w over n values: one vector accumulator over whole vectors, then the scalar tail.
 * Every product below is this exact sum, whatever the blocking, so one row decoded alone
 * (a direct step) and the same row in a verification get bitwise the same logits. */
static inline float dot(const float *x, const float *w, int64_t n) {
    vec a = {0};
    int64_t k = 0;
    for (; k + VW <= n; k += VW) a = fmav(load(x + k), load(w + k), a);
    float s = hsum(a);
    for (; k < n; k++) s = FMAS(x[k], w[k], s);
    return s;
}

/* Prefetch the part of a 4-row block (4n contiguous floats) that matches columns
 * k .. k + VW of one row: 4 VW floats, so the block is covered once its row loop ends. */
static inline void prefetch_block(const float *block, int64_t k) {
    for (int j = 0; j < 4 * VW; j += 16) __builtin_prefetch(block + 4 * k + j, 0, 3);
}

/* Y[i, r] = W[r, :] . X[i, :] for r < rows, i < q (W [rows, n], X [q, n], Y [q, ldy]):
 * four weight rows x two inputs in flight, each weight row read once per two inputs. */
static void gemm_inputs(const float *W, const float *X, float *Y, int64_t rows, int64_t n,
                        int64_t q, int64_t ldy) {
    int64_t r = 0;
    const int64_t whole = n - n % VW;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = W + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        /* The next block's four rows (contiguous after these), fetched from L3 while this
         * block computes: the first pass over a block otherwise waits on each row's lines. */
        const float *next = r + 8 <= rows ? W + (r + 4) * n : 0;
        int64_t i = 0;
#if VW == 16
        /* Four inputs at a time where 32 registers hold the 16 accumulators and the 8 loads
         * (AVX-512): 8 loads per 16 FMAs instead of 6 per 8, each accumulator the same sum
         * as below, so a batched step or a verification gains with no bit changed. */
        for (; i + 4 <= q; i += 4) {
            const float *x0 = X + i * n, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n;
            const float *pf = i == 0 ? next : 0;
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            vec e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0}, f0 = {0}, f1 = {0}, f2 = {0}, f3 = {0};
            for (int64_t k = 0; k < whole; k += VW) {
                if (pf) prefetch_block(pf, k);
                vec u = load(x0 + k), v = load(x1 + k), t = load(x2 + k), z = load(x3 + k);
                vec c0 = load(w0 + k), c1 = load(w1 + k), c2 = load(w2 + k), c3 = load(w3 + k);
                PIN(u); PIN(v); PIN(t); PIN(z); PIN(c0); PIN(c1); PIN(c2); PIN(c3);
                a0 = fmav(c0, u, a0); a1 = fmav(c1, u, a1);
                a2 = fmav(c2, u, a2); a3 = fmav(c3, u, a3);
                b0 = fmav(c0, v, b0); b1 = fmav(c1, v, b1);
                b2 = fmav(c2, v, b2); b3 = fmav(c3, v, b3);
                e0 = fmav(c0, t, e0); e1 = fmav(c1, t, e1);
                e2 = fmav(c2, t, e2); e3 = fmav(c3, t, e3);
                f0 = fmav(c0, z, f0); f1 = fmav(c1, z, f1);
                f2 = fmav(c2, z, f2); f3 = fmav(c3, z, f3);
            }
            float s[16];
            const vec acc[16] = {a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3};
            hsum16(acc, s);
            const float *xs[4] = {x0, x1, x2, x3};
            for (int64_t k = whole; k < n; k++)
                for (int g = 0; g < 4; g++) {
                    float *sg = s + 4 * g;
                    sg[0] = FMAS(xs[g][k], w0[k], sg[0]); sg[1] = FMAS(xs[g][k], w1[k], sg[1]);
                    sg[2] = FMAS(xs[g][k], w2[k], sg[2]); sg[3] = FMAS(xs[g][k], w3[k], sg[3]);
                }
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < 4; j++) Y[(i + g) * ldy + r + j] = s[4 * g + j];
        }
#endif
        for (; i + 2 <= q; i += 2) {
            const float *x0 = X + i * n, *x1 = x0 + n;
            const float *pf = i == 0 ? next : 0;
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t k = 0; k < whole; k += VW) {
                if (pf) prefetch_block(pf, k);
                vec u = load(x0 + k), v = load(x1 + k);
                vec c0 = load(w0 + k), c1 = load(w1 + k), c2 = load(w2 + k), c3 = load(w3 + k);
                PIN(u); PIN(v); PIN(c0); PIN(c1); PIN(c2); PIN(c3);
                a0 = fmav(c0, u, a0); a1 = fmav(c1, u, a1);
                a2 = fmav(c2, u, a2); a3 = fmav(c3, u, a3);
                b0 = fmav(c0, v, b0); b1 = fmav(c1, v, b1);
                b2 = fmav(c2, v, b2); b3 = fmav(c3, v, b3);
            }
            float s[8];
            hsum4(a0, a1, a2, a3, s);
            hsum4(b0, b1, b2, b3, s + 4);
            for (int64_t k = whole; k < n; k++) {
                s[0] = FMAS(x0[k], w0[k], s[0]); s[1] = FMAS(x0[k], w1[k], s[1]);
                s[2] = FMAS(x0[k], w2[k], s[2]); s[3] = FMAS(x0[k], w3[k], s[3]);
                s[4] = FMAS(x1[k], w0[k], s[4]); s[5] = FMAS(x1[k], w1[k], s[5]);
                s[6] = FMAS(x1[k], w2[k], s[6]); s[7] = FMAS(x1[k], w3[k], s[7]);
            }
            for (int j = 0; j < 4; j++) {
                Y[i * ldy + r + j] = s[j];
                Y[(i + 1) * ldy + r + j] = s[4 + j];
            }
        }
        for (; i < q; i++) {
            const float *x0 = X + i * n;
            const float *pf = i == 0 ? next : 0;
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < whole; k += VW) {
                if (pf) prefetch_block(pf, k);
                vec u = load(x0 + k);
                a0 = fmav(load(w0 + k), u, a0); a1 = fmav(load(w1 + k), u, a1);
                a2 = fmav(load(w2 + k), u, a2); a3 = fmav(load(w3 + k), u, a3);
            }
            float s[4];
            hsum4(a0, a1, a2, a3, s);
            for (int64_t k = whole; k < n; k++) {
                s[0] = FMAS(x0[k], w0[k], s[0]); s[1] = FMAS(x0[k], w1[k], s[1]);
                s[2] = FMAS(x0[k], w2[k], s[2]); s[3] = FMAS(x0[k], w3[k], s[3]);
            }
            for (int j = 0; j < 4; j++) Y[i * ldy + r + j] = s[j];
        }
    }
    for (; r < rows; r++)
        for (int64_t i = 0; i < q; i++) Y[i * ldy + r] = dot(X + i * n, W + r * n, n);
}

/* The inputs gemm_inputs takes at once: as many as fit in GEMM_X_BYTES (a whole number of
 * its four-input passes). Every four-row block of W passes over all of a call's inputs, so
 * a verification's or a full batch's X (hundreds of rows) would come back from L2 once per
 * block; in chunks that stay in L1 each block is read again per chunk instead, from L2
 * where a product's weights fit there (the built-in model's do). */
#define GEMM_X_BYTES (24 * 1024)

/* gemm_inputs over X in chunks: every sum is dot's whatever the chunk, so no bit changes. */
static void gemm(const float *W, const float *X, float *Y, int64_t rows, int64_t n, int64_t q,
                 int64_t ldy) {
    int64_t chunk = GEMM_X_BYTES / ((int64_t)sizeof(float) * n) / 4 * 4;
    if (chunk < 4) chunk = 4;
    for (int64_t i = 0; i < q; i += chunk)
        gemm_inputs(W, X + i * n, Y + i * ldy, rows, n, q - i < chunk ? q - i : chunk, ldy);
}

/* ---- int8 weights times int8 activations: each input row is quantized on the fly
 * (symmetric, its absmax / 127) and the products summed in int32, exactly, whatever the
 * blocking; Y[i, r] = S[r] * xs[i] * sum. Kept over widening the int8 rows to float in
 * registers (the float loop on a quarter of the bytes): as fast from memory and faster
 * where the weights sit in cache, at the same agreement. With AVX-512 VNNI the
 * activations are stored offset by 128 (vpdpbusd multiplies unsigned by signed bytes) and 128 * the row's sum of
 * weights (C[r]) is taken off after; AVX2 uses the sign trick (|w| times x with w's
 * sign), which needs no correction. ---- */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT_OFFSET 128
#define DW 64
static inline __m512i dp(__m512i acc, const uint8_t *x, const int8_t *w) {
    return _mm512_dpbusd_epi32(acc, _mm512_loadu_si512((const void *)x),
                               _mm512_loadu_si512((const void *)w));
}
static inline int32_t isum(__m512i a) { return _mm512_reduce_add_epi32(a); }
typedef __m512i ivec;
static inline ivec izero(void) { return _mm512_setzero_si512(); }
#elif defined(__AVX2__)
#include <immintrin.h>
#define DOT_OFFSET 0
#define DW 32
static inline __m256i dp(__m256i acc, const uint8_t *x, const int8_t *w) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    /* |w| (unsigned) times x with w's sign: |products| <= 127 * 127 * 2, no saturation */
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline int32_t isum(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
typedef __m256i ivec;
static inline ivec izero(void) { return _mm256_setzero_si256(); }
#else
#define DOT_OFFSET 0
#define DW 0
#endif

/* Quantize x [n] into xq (offset by DOT_OFFSET); return its scale. The row is padded to
 * whole DW-byte chunks with zeros (offset), which meet zero weights in the last chunk. */
static float quantize_row(const float *x, uint8_t *xq, int64_t n) {
    float top = 0.0f;
    int64_t k = 0;
#if DW == 64
    /* max(|x|, top) returns top where x is NaN, as the scalar comparison below skips it */
    __m512 most = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16)
        most = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), most);
    top = _mm512_reduce_max_ps(most);
#elif DW == 32
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8)
        most = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), most);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; k < n; k++) {
        const float a = fabsf(x[k]);
        if (a > top) top = a;
    }
    const int64_t padded = DW ? (n + DW - 1) / DW * DW : n;
    for (int64_t k = n; k < padded; k++) xq[k] = (uint8_t)DOT_OFFSET;
    if (!(top > 0.0f) || !isfinite(top)) {
        /* all zero: any scale; inf or NaN: the float path's answer is no better */
        for (int64_t k = 0; k < n; k++) xq[k] = (uint8_t)DOT_OFFSET;
        return top > 0.0f ? top : 0.0f;
    }
    const float inv = 127.0f / top;
    k = 0;
#if DW == 64
    /* vcvtps2dq rounds as lrintf does (to nearest, ties to even: the default mode), and
     * a NaN's byte is the offset in both; the low byte of each sum is kept */
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i offset = _mm512_set1_epi32(DOT_OFFSET);
    for (; k + 16 <= n; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv));
        _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, offset)));
    }
#elif DW == 32
    /* the same conversion, and each sum's low byte gathered by a shuffle (a saturating
     * pack would turn a NaN's INT_MIN into -128 where lrintf's low byte is 0) */
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, -1, -1);
    const __m256i halves = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    for (; k + 8 <= n; k += 8) {
        const __m256i v = _mm256_add_epi32(
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv)),
            _mm256_set1_epi32(DOT_OFFSET));
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, low), halves);
        _mm_storel_epi64((__m128i *)(xq + k), _mm256_castsi256_si128(bytes));
    }
#endif
    for (; k < n; k++)
        xq[k] = (uint8_t)((int32_t)lrintf(x[k] * inv) + DOT_OFFSET);
    return top / 127.0f;
}

/* The sums of four accumulators, lane j holding a_j's (exact: int32 adds). Four weight
 * rows share one reduction tree: reducing each accumulator on its own (isum) cost several
 * times the row's few VNNI products at the built-in widths. */
#if DW
static inline __m128i isum4_256(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    /* hadd pairs neighbours within each 128-bit lane: after two rounds lane j of each half
     * holds half of a_j's sum, and the halves add up. */
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#if DW == 64
static inline __m256i fold_epi32(__m512i a) {
    return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}
static inline __m128i isum4(ivec a0, ivec a1, ivec a2, ivec a3) {
    return isum4_256(fold_epi32(a0), fold_epi32(a1), fold_epi32(a2), fold_epi32(a3));
}
#else
static inline __m128i isum4(ivec a0, ivec a1, ivec a2, ivec a3) {
    return isum4_256(a0, a1, a2, a3);
}
#endif
#endif

/* The largest int8 weight (bytes) multiplied in blocks of four rows: well within a core's
 * L2, as the built-in model's are (a T5-small's 512 x 512 ones are not). */
#define Q8_BLOCKED_BYTES (128 * 1024)
/* ... and any int8 weight against this many inputs or more (a batched step or
 * verification), where each row read serves enough inputs to hide the streams. */
#define Q8_BLOCKED_INPUTS 8

#if DW == 64
/* Several inputs against one weight (a batched step, a verification) with VNNI: sixteen
 * weight rows at a time, repacked at bind so that one vector holds four consecutive bytes
 * of each of the sixteen rows. A broadcast of four activation bytes then multiplies all
 * sixteen rows at once, each int32 lane accumulating one row's sum: no horizontal
 * reduction per output, which at the built-in widths cost as much as the products. */
/* From this many inputs (the repacking is paid once, at bind); one to three inputs (a lone
 * row's step) run as fast through the four-row blocks, which stream the weights the same
 * way, and a tile multiply pads its inputs to sixteen rows
 * (docs/benchmarks.md#amx-tiles-for-the-int8-products). */
#define Q8_PACKED_INPUTS 4
/* The tiles' last block of inputs on the stack: 16 rows x n bytes (inputs of 8192 at most). */
#define Q8_PACKED_MAX_N 8192

/* Y[i, r .. r + 16) for m inputs (a constant where inlined) against one repacked block. */
static inline __attribute__((always_inline)) void q8_block(
        const int32_t *pack, int64_t groups, const uint8_t *xq, int64_t stride,
        const float *xs, __m512i fix, __m512 scale, __mmask16 live, float *Y, int64_t ldy,
        const int m) {
    __m512i acc[8];
    for (int t = 0; t < m; t++) acc[t] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const __m512i w = _mm512_load_si512((const void *)(pack + 16 * g));
        for (int t = 0; t < m; t++) {
            int32_t x4;
            memcpy(&x4, xq + t * stride + 4 * g, sizeof x4);
            /* in place: gcc copies each accumulator to a new register around the
             * intrinsic (two moves per product) */
            __asm__("vpdpbusd %1, %2, %0" : "+v"(acc[t]) : "v"(w), "v"(_mm512_set1_epi32(x4)));
        }
    }
    for (int t = 0; t < m; t++) {
        /* S[r] * (xs[i] * (float)sum), the order of the loops below */
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t], fix));
        _mm512_mask_storeu_ps(Y + t * ldy, live,
                              _mm512_mul_ps(scale, _mm512_mul_ps(_mm512_set1_ps(xs[t]), sums)));
    }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
/* AMX (a CPU with int8 tiles, and a kernel that lets this process use them): sixteen inputs
 * x sixteen weight rows a tile multiply, whose B operand is the repacked block as it is
 * (sixteen groups of four bytes of sixteen rows, 64 bytes a group) and whose A operand is
 * sixteen rows of the offset activations. The int32 sums are exact, so each output is
 * vpdpbusd's bit for bit. */
#define AMX_C_TILES 4 /* tiles 0-3: sums of up to 64 inputs; 4: activations; 5: weights */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Whether this process may use the tiles: Linux grants their state on request, once. */
static int amx_allowed(void) {
    static int allowed = -1;
    if (allowed < 0)
        allowed = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return allowed;
}

/* The sums of inputs i0 .. i0 + 16 nb (nb <= AMX_C_TILES) against one repacked block of
 * ktiles x 16 groups (padded with zero weights), into sums[16 nb][16]. */
static void amx_block(const int32_t *pack, int64_t ktiles, const uint8_t *xq, int64_t stride,
                      int nb, int32_t *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kt = 0; kt < ktiles; kt++) {
        _tile_loadd(5, pack + 256 * kt, 64);
        const uint8_t *a = xq + 64 * kt;
        _tile_loadd(4, a, stride);
        _tile_dpbusd(0, 4, 5);
        if (nb > 1) {
            _tile_loadd(4, a + 16 * stride, stride);
            _tile_dpbusd(1, 4, 5);
        }
        if (nb > 2) {
            _tile_loadd(4, a + 32 * stride, stride);
            _tile_dpbusd(2, 4, 5);
        }
        if (nb > 3) {
            _tile_loadd(4, a + 48 * stride, stride);
            _tile_dpbusd(3, 4, 5);
        }
    }
    _tile_stored(0, sums, 64);
    if (nb > 1) _tile_stored(1, sums + 256, 64);
    if (nb > 2) _tile_stored(2, sums + 512, 64);
    if (nb > 3) _tile_stored(3, sums + 768, 64);
}
#endif

/* gemm_q8_dot's products against P, the weight repacked at bind (engine.native.repack_int8:
 * blocks of sixteen rows, each `padded` groups x 16 int32), bit for bit its sums (exact in
 * int32: only the order of the adds differs). xq's rows are padded to whole DW chunks with
 * the offset, so the last group of four bytes is there to read; its missing weights are 0. */
static void gemm_q8_packed(const int32_t *P, const float *S, const int32_t *C,
                           float *Y, int64_t rows, int64_t n, int64_t q, int64_t ldy,
                           const uint8_t *xq, const float *xs, int64_t stride) {
    const int64_t groups = (n + 3) / 4;
    /* whole 64-byte chunks of groups: the tiles read 16 groups at a time */
    const int64_t padded = (groups + 15) / 16 * 16;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    const int tiles = amx_allowed();
    int32_t sums[AMX_C_TILES * 256] __attribute__((aligned(64)));
    /* The inputs past the last whole sixteen, in a block of sixteen rows of their own (the
     * rows after them are read and their sums dropped). */
    const int64_t full = q / 16 * 16, rest = q - full;
    uint8_t last[tiles && rest ? 16 * stride : 1] __attribute__((aligned(64)));
    if (tiles) {
        if (rest) {
            memcpy(last, xq + full * stride, (size_t)(rest * stride));
            memset(last + rest * stride, 0, (size_t)((16 - rest) * stride));
        }
        TileConfig cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 6; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
    }
#else
    const int tiles = 0;
#endif
    for (int64_t r = 0; r < rows; r += 16) {
        const int32_t *pack = P + r * padded;
        const int64_t live_rows = rows - r < 16 ? rows - r : 16;
        const __mmask16 live = (__mmask16)((1u << live_rows) - 1u);
        const __m512i fix = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(live, C + r), 7);
        const __m512 scale = _mm512_maskz_loadu_ps(live, S + r);
        int64_t i = 0;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
        while (tiles && i < q) {
            const int64_t blocks = (full - i) / 16;
            const int nb = (int)(blocks < AMX_C_TILES ? blocks : AMX_C_TILES);
            const int64_t m = nb ? 16 * nb : rest;
            if (nb)
                amx_block(pack, padded / 16, xq + i * stride, stride, nb, sums);
            else
                amx_block(pack, padded / 16, last, stride, 1, sums);
            for (int64_t t = 0; t < m; t++) {
                /* as q8_block: S[r] * (xs[i] * (float)sum) */
                const __m512 s = _mm512_cvtepi32_ps(
                    _mm512_sub_epi32(_mm512_load_si512((const void *)(sums + 16 * t)), fix));
                const __m512 x = _mm512_mul_ps(_mm512_set1_ps(xs[i + t]), s);
                _mm512_mask_storeu_ps(Y + (i + t) * ldy + r, live, _mm512_mul_ps(scale, x));
            }
            i += m;
        }
#endif
#define Q8_BLOCK(m) q8_block(pack, groups, xq + i * stride, stride, xs + i, fix, scale, live, \
                             Y + i * ldy + r, ldy, m)
        for (; i + 8 <= q; i += 8) Q8_BLOCK(8);
        switch (q - i) {
        case 7: Q8_BLOCK(7); break;
        case 6: Q8_BLOCK(6); break;
        case 5: Q8_BLOCK(5); break;
        case 4: Q8_BLOCK(4); break;
        case 3: Q8_BLOCK(3); break;
        case 2: Q8_BLOCK(2); break;
        case 1: Q8_BLOCK(1); break;
        default: break;
        }
#undef Q8_BLOCK
    }
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (tiles) _tile_release();  /* the tiles' state is large: not kept between calls */
#else
    (void)tiles;
#endif
}
#endif

/* Y[i, r] = S[r] * xs[i] * (Q[r, :] . xq[i, :]); xq: q rows of `stride` bytes (at least n
 * rounded up to DW), scratch. */
static void gemm_q8_dot(const int8_t *W, const int32_t *P, const float *S, const int32_t *C,
                        const float *X, float *Y, int64_t rows, int64_t n, int64_t q,
                        int64_t ldy, uint8_t *xq, float *xs, int64_t stride) {
    for (int64_t i = 0; i < q; i++) xs[i] = quantize_row(X + i * n, xq + i * stride, n);
#if DW == 64
    if (P && n <= Q8_PACKED_MAX_N && q >= Q8_PACKED_INPUTS) {
        gemm_q8_packed(P, S, C, Y, rows, n, q, ldy, xq, xs, stride);
        return;
    }
#else
    (void)P;
#endif
#if DW
    /* A row's last partial chunk is copied into a zero-padded one: every product goes
     * through the same vector instruction (gcc 12 -O3 miscompiled a scalar tail loop of
     * unsigned x signed bytes with AVX-512). The offset activations then add 128 x the
     * row's whole sum of weights, C[r], taken off after. Every sum is exact in int32, so
     * how rows and inputs are blocked changes no bit of Y. */
    const int64_t whole = n - n % DW;
    int8_t tail[4][DW] __attribute__((aligned(64)));
    int64_t r = 0;
    /* A weight that stays in cache between steps (a small model's), or one read for many
     * inputs: four rows at a time, every input against them, one reduction for the four
     * rows' sums and their scales applied together. A larger one read from memory for a
     * few inputs (a T5-small's, one row's step or verification): one row after another
     * below, the weights in address order, one sequential stream that the prefetchers
     * follow; four rows read chunk by chunk side by side ran at up to half its speed there,
     * and the reductions are a small part of a row streamed from memory. */
    const int blocked = rows * n <= Q8_BLOCKED_BYTES || q >= Q8_BLOCKED_INPUTS;
    for (; blocked && r + 4 <= rows; r += 4) {
        const int8_t *w[4] = {W + r * n, W + (r + 1) * n, W + (r + 2) * n, W + (r + 3) * n};
        if (whole < n)
            for (int j = 0; j < 4; j++) {
                memset(tail[j], 0, sizeof tail[j]);
                memcpy(tail[j], w[j] + whole, (size_t)(n - whole));
            }
        const __m128i fix = _mm_set_epi32(DOT_OFFSET * C[r + 3], DOT_OFFSET * C[r + 2],
                                          DOT_OFFSET * C[r + 1], DOT_OFFSET * C[r]);
        const __m128 scale = _mm_loadu_ps(S + r);
        for (int64_t i = 0; i < q; i++) {
            const uint8_t *x0 = xq + i * stride;
            ivec a0 = izero(), a1 = izero(), a2 = izero(), a3 = izero();
            for (int64_t k = 0; k < whole; k += DW) {
                a0 = dp(a0, x0 + k, w[0] + k);
                a1 = dp(a1, x0 + k, w[1] + k);
                a2 = dp(a2, x0 + k, w[2] + k);
                a3 = dp(a3, x0 + k, w[3] + k);
            }
            if (whole < n) {
                a0 = dp(a0, x0 + whole, tail[0]);
                a1 = dp(a1, x0 + whole, tail[1]);
                a2 = dp(a2, x0 + whole, tail[2]);
                a3 = dp(a3, x0 + whole, tail[3]);
            }
            /* S[r] * (xs[i] * (float)sum), in the scalar loop's order */
            const __m128 sums = _mm_cvtepi32_ps(_mm_sub_epi32(isum4(a0, a1, a2, a3), fix));
            _mm_storeu_ps(Y + i * ldy + r, _mm_mul_ps(scale, _mm_mul_ps(_mm_set1_ps(xs[i]), sums)));
        }
    }
    for (; r < rows; r++) {
        const int8_t *w = W + r * n;
        if (whole < n) {
            memset(tail[0], 0, sizeof tail[0]);
            memcpy(tail[0], w + whole, (size_t)(n - whole));
        }
        const int32_t fix = DOT_OFFSET * C[r];
        for (int64_t i = 0; i < q; i++) {
            const uint8_t *x0 = xq + i * stride;
            ivec a = izero(), b = izero();
            int64_t k = 0;
            for (; k + 2 * DW <= whole; k += 2 * DW) {
                a = dp(a, x0 + k, w + k);
                b = dp(b, x0 + k + DW, w + k + DW);
            }
            if (k < whole) a = dp(a, x0 + k, w + k);
            if (whole < n) b = dp(b, x0 + whole, tail[0]);
            Y[i * ldy + r] = S[r] * (xs[i] * (float)(isum(a) + isum(b) - fix));
        }
    }
#else
    (void)C;
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *w = W + r * n;
        for (int64_t i = 0; i < q; i++) {
            const int8_t *x0 = (const int8_t *)(xq + i * stride);
            int32_t s = 0;
            for (int64_t k = 0; k < n; k++) s += (int32_t)x0[k] * (int32_t)w[k];
            Y[i * ldy + r] = S[r] * (xs[i] * (float)s);
        }
    }
#endif
}

/* One linear layer's weight in whichever form the model holds it. */
typedef struct {
    const float *f;
    const int8_t *q;
    const float *s;
    const int32_t *c;
    const int32_t *p;
} Lin;

#define LAYER_LIN(m, name, l)                                                              \
    ((m)->wmode == W_FLOAT ? (Lin){(m)->name[l], 0, 0, 0, 0}                               \
                           : (Lin){0, (m)->name##_q[l], (m)->name##_s[l], (m)->name##_c[l], \
                                   (m)->name##_p ? (m)->name##_p[l] : 0})

/* The int8-activation scratch of a call: q rows of `stride` bytes, then q scales. */
typedef struct {
    uint8_t *xq;
    float *xs;
    int64_t stride;
} QScratch;

/* Y[i, r] = W[r, :] . X[i, :] for every row r < rows and input i < q (see gemm). */
static void linear(const Model *m, Lin w, const float *X, float *Y, int64_t rows, int64_t n,
                   int64_t q, int64_t ldy, QScratch qs) {
    if (m->wmode == W_INT8)
        gemm_q8_dot(w.q, w.p, w.s, w.c, X, Y, rows, n, q, ldy, qs.xq, qs.xs, qs.stride);
    else
        gemm(w.f, X, Y, rows, n, q, ldy);
}

/* The widest input of any linear layer: the int8 activations' row stride (64-byte rows). */
static int64_t qstride(const Model *m) {
    int64_t n = m->d_model > m->inner ? m->d_model : m->inner;
    if (m->d_ff > n) n = m->d_ff;
    return (n + 63) / 64 * 64;
}

/* out = w * (x / rms(x)), the sum of squares by dot (lane by lane over whole vectors, then
 * hsum and the tail): one add per value waiting on the one before made each norm a chain of
 * dependent adds as long as its row, three norms a layer. A row's sum reads only that row,
 * so batching stays exact. */
static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static float activate(float v, int64_t act) {
    switch (act) {
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    case ACT_GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    default: return v / (1.0f + expf(-v));
    }
}

/* Queries attending one K/V together (a verification's positions of one request, whose
 * rows share their caches): up to ATT_ROWS at once, each K and V line read once for all of
 * them, where one query at a time read each line again and kept only d_kv / VW
 * accumulators in flight (each waiting on its own previous add for every key). */
#define ATT_ROWS 8
/* Accumulators a pass of weigh_block keeps in registers: with the V vectors and the score
 * broadcast they fill AVX-512's 32 registers, or AVX2's and SSE's 16. */
#if VW == 16
#define ACC_REGS 24
#else
#define ACC_REGS 10
#endif

/* out_r[d .. d + g VW] = inv[r] * sum_j scores_r[j] V[j][d ..] for R queries (scores_r =
 * scores + r ld, query r over its first n[r] keys), keys in order: each lane of each query
 * the same sum whatever R and g (they only set what is in flight), so a query weighed with
 * others is bit for bit the query weighed alone. */
static inline __attribute__((always_inline)) void weigh_block(
        const float *scores, int64_t ld, const float *V, const int64_t *n, int64_t d_kv,
        int64_t d, const int R, const int g, const float *inv, float *out, int64_t os) {
    vec acc[ATT_ROWS][8];
    int64_t common = n[0];
    for (int r = 1; r < R; r++)
        if (n[r] < common) common = n[r];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < g; t++) acc[r][t] = (vec){0};
    for (int64_t j = 0; j < common; j++) {
        const float *v = V + j * d_kv + d;
        vec w[8];
        for (int t = 0; t < g; t++) {
            w[t] = load(v + t * VW);
            if (R > 1) PIN(w[t]);  /* one load for R queries, not one folded into each */
        }
        for (int r = 0; r < R; r++) {
            const float s = scores[r * ld + j];
            for (int t = 0; t < g; t++) acc[r][t] = fmav(bcast(s), w[t], acc[r][t]);
        }
    }
    /* A query with more keys (a later position of the same request) goes on alone. */
    for (int r = 0; r < R; r++)
        for (int64_t j = common; j < n[r]; j++) {
            const float *v = V + j * d_kv + d;
            const float s = scores[r * ld + j];
            for (int t = 0; t < g; t++) acc[r][t] = fmav(bcast(s), load(v + t * VW), acc[r][t]);
        }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < g; t++) *(vec *)(out + r * os + d + t * VW) = acc[r][t] * inv[r];
}

/* One (R, G) pass, compiled only where its accumulators fit the registers: weigh_rows never
 * asks for more (it caps g at ACC_REGS / R), and the passes it cannot take would only add
 * to the build. */
#define WEIGH(R, G)                                                                      \
    case G:                                                                              \
        if ((R) * (G) <= ACC_REGS)                                                       \
            weigh_block(scores, ld, V, n, d_kv, d, R, G, inv, out, os);                  \
        break;
#define WEIGH_G(R)                                                                       \
    switch (g) {                                                                         \
    WEIGH(R, 8) WEIGH(R, 7) WEIGH(R, 6) WEIGH(R, 5) WEIGH(R, 4) WEIGH(R, 3) WEIGH(R, 2)  \
    default: weigh_block(scores, ld, V, n, d_kv, d, R, 1, inv, out, os); break;         \
    }

/* Weigh R (8, 4, 2 or 1) queries' V over every whole vector of d_kv, then the scalar tail. */
static void weigh_rows(int R, const float *scores, int64_t ld, const float *V,
                       const int64_t *n, int64_t d_kv, const float *inv, float *out,
                       int64_t os) {
    int64_t most = ACC_REGS / R;
    if (most > 8) most = 8;
    if (most < 1) most = 1;
    int64_t d = 0;
    while (d + VW <= d_kv) {
        int64_t g = (d_kv - d) / VW;
        if (g > most) g = most;
        switch (R) {
        case 8: WEIGH_G(8) break;
        case 4: WEIGH_G(4) break;
        case 2: WEIGH_G(2) break;
        default: WEIGH_G(1) break;
        }
        d += g * VW;
    }
    for (; d < d_kv; d++)
        for (int r = 0; r < R; r++) {
            const float *s = scores + r * ld;
            float acc = 0.0f;
            for (int64_t j = 0; j < n[r]; j++) acc = FMAS(s[j], V[j * d_kv + d], acc);
            out[r * os + d] = acc * inv[r];
        }
}

typedef int32_t ivec32 __attribute__((vector_size(VW * 4)));

/* Lane by lane: where m (a comparison's all-ones lanes), a, else b. */
static inline vec blend(ivec32 m, vec a, vec b) {
    return (vec)((m & (ivec32)a) | (~m & (ivec32)b));
}

/* exp(x) lane by lane, for the softmax's x <= 0, in place of a libm call a score: 2^n exp(r)
 * with n = round(x / ln 2) and |r| <= ln 2 / 2 (ln 2 in two parts), exp(r) by Cephes'
 * degree-6 polynomial; below -87.3 (2^-126) it is 0, so a masked key still weighs exactly
 * 0, and a NaN stays NaN. Every multiply-add is an explicit FMA: the same bits wherever the
 * compiler inlines it. */
static inline vec vexp(vec x) {
    const ivec32 under = x < -87.33654f;  /* a NaN is not: it stays NaN */
    const vec floor_x = blend(under, bcast(-87.33654f), x);
    const vec shift = bcast(12582912.0f);  /* 1.5 * 2^23: adding it rounds to an integer */
    const vec n = fmav(floor_x, bcast(1.44269504088896341f), shift) - shift;
    vec r = fmav(n, bcast(-0.693359375f), floor_x);
    r = fmav(n, bcast(2.12194440e-4f), r);
    vec p = bcast(1.9875691500e-4f);
    p = fmav(p, r, bcast(1.3981999507e-3f));
    p = fmav(p, r, bcast(8.3334519073e-3f));
    p = fmav(p, r, bcast(4.1665795894e-2f));
    p = fmav(p, r, bcast(1.6666665459e-1f));
    p = fmav(p, r, bcast(5.0000001201e-1f));
    p = fmav(p, r * r, r) + 1.0f;
    const vec scale = (vec)((__builtin_convertvector(n, ivec32) + 127) << 23);
    return blend(under, (vec){0}, p * scale);
}

/* scores[j] = exp(scores[j] + bias[j] - max) for j < n; return 1 / their sum. The max is
 * the same value in any order (NaNs skipped, as `>` skips them);
 * the sum runs lane by lane over whole vectors, the tail's lanes padded with exp(-inf) = 0,
 * then across the lanes: the same order for a query whatever shares its call. */
static float softmax(float *scores, const float *bias, int64_t n) {
    vec topv = (vec){0} - INFINITY;
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vec s = load(scores + j) + load(bias + j);
        *(vec *)(scores + j) = s;
        topv = blend(s > topv, s, topv);
    }
    float top = -INFINITY;
    for (int i = 0; i < VW; i++)
        if (topv[i] > top) top = topv[i];
    for (int64_t k = j; k < n; k++) {
        scores[k] += bias[k];
        if (scores[k] > top) top = scores[k];
    }
    vec sum = (vec){0};
    for (j = 0; j + VW <= n; j += VW) {
        const vec e = vexp(load(scores + j) - top);
        *(vec *)(scores + j) = e;
        sum += e;
    }
    if (j < n) {
        vec tail = (vec){0} - INFINITY;
        for (int64_t k = j; k < n; k++) tail[k - j] = scores[k] - top;
        const vec e = vexp(tail);
        for (int64_t k = j; k < n; k++) scores[k] = e[k - j];
        sum += e;
    }
    return 1.0f / hsum(sum);
}

/* out_r = softmax_j(q_r . K[j] + bias[r][j]) V[j] over j < n[r], for the p <= ATT_ROWS
 * queries q_r = q + r qs (their outputs out + r os), K and V [.., d_kv] row-major; scores:
 * p rows of ld >= max n floats. Each query's arithmetic is that of the query alone (p = 1):
 * gemm's sums do not depend on how many inputs share its pass, and weigh_block's do not
 * depend on how many queries share its. */
static void attend_rows(const float *q, int64_t qs, const float *K, const float *V,
                        const float *const *bias, const int64_t *n, int64_t p, int64_t d_kv,
                        float *scores, int64_t ld, float *out, int64_t os) {
    float x[p * d_kv];
    float inv[ATT_ROWS];
    int64_t most = 0;
    for (int64_t r = 0; r < p; r++) {
        memcpy(x + r * d_kv, q + r * qs, (size_t)d_kv * sizeof(float));
        if (n[r] > most) most = n[r];
    }
    gemm(K, x, scores, most, d_kv, p, ld);
    for (int64_t r = 0; r < p; r++) inv[r] = softmax(scores + r * ld, bias[r], n[r]);
    for (int64_t r = 0; r < p;) {
        const int R = p - r >= 8 ? 8 : p - r >= 4 ? 4 : p - r >= 2 ? 2 : 1;
        weigh_rows(R, scores + r * ld, ld, V, n + r, d_kv, inv + r, out + r * os, os);
        r += R;
    }
}

/* The keys of a cross-attention to read: trailing keys whose bias is -FLT_MAX (bucket
 * padding, engine.t5.LeanT5.mask_bias) get weight exactly 0 next to any unmasked key (their
 * exp underflows), so skipping them changes no bit of the output and saves reading their
 * K/V, the bulk of a batched step's memory traffic. All masked: every key is read. */
static int64_t unmasked(const float *bias, int64_t n) {
    int64_t keys = n;
    while (keys > 0 && bias[keys - 1] <= -FLT_MAX) keys--;
    return keys > 0 ? keys : n;
}

/* Decode `q` rows in one call, each weight read once for all of them: row i feeds
 * tokens[i] at position pos[i] into its own self-attention cache self_kv[i] (writing its
 * K/V there) and attends its own cross K/V cross_kv[i] (cross[i] positions, padding mask
 * cross_bias[i]); out[i] is the greedy next token. Rows may be one request's consecutive
 * positions (a verification: the same cache, every row's K/V written before any row
 * attends) or different requests (a batched step: their own caches, buckets, lengths).
 * Each row's arithmetic is that of the row decoded alone (gemm's sums do not depend on
 * the blocking), so batching and verification never change a token.
 *
 * self_kv[i] [layers, 2, heads, slots1, d_kv]; cross_kv[i] [layers, 2, heads, cross[i],
 * d_kv]; dec_bias [heads, span, span] (positions and the causal mask; row pos[i] is read,
 * keys < min(pos[i] + 1, span)); scratch: engine.native's size for q rows, plus
 * ATT_ROWS (tw_att_rows) times max(span, max cross) floats. logits_out (NULL: not wanted)
 * receives the q rows' logits [q, vocab] (tests compare them with a float reference).
 */
static void rows(const Model *m, const int64_t *tokens, int64_t q, const int64_t *pos,
                 float *const *self_kv, int64_t slots1, const float *const *cross_kv,
                 const int64_t *cross, const float *const *cross_bias, const float *dec_bias,
                 int64_t span, float *scratch, int64_t *out, float *logits_out) {
    const int64_t D = m->d_model, H = m->heads, dk = m->d_kv, I = m->inner;
    const int64_t ff = m->gated ? 2 * m->d_ff : m->d_ff;
    int64_t widest = span;
    for (int64_t i = 0; i < q; i++)
        if (cross[i] > widest) widest = cross[i];
    float *x = scratch, *h = x + q * D, *qkv = h + q * D, *att = qkv + q * 3 * I;
    float *u = att + q * I;
    float *scores = u + q * ff;  /* ATT_ROWS rows of max(span, max cross) */
    float *logits = scores + ATT_ROWS * widest;
    /* int8 activations (W_INT8): q rows of qstride bytes, then q scales */
    const int64_t stride = qstride(m);
    QScratch qs = {(uint8_t *)(logits + q * m->vocab), 0, stride};
    qs.xs = (float *)(qs.xq + q * stride);
    for (int64_t i = 0; i < q; i++)
        memcpy(x + i * D, m->embed + tokens[i] * D, (size_t)D * sizeof(float));
    for (int64_t l = 0; l < m->layers; l++) {
        /* self-attention over the cache prefix, these positions' K/V written first */
        for (int64_t i = 0; i < q; i++) rms_norm(x + i * D, m->ln_att[l], h + i * D, D, m->eps);
        linear(m, LAYER_LIN(m, qkv, l), h, qkv, 3 * I, D, q, 3 * I, qs);
        for (int64_t i = 0; i < q; i++) {
            float *layer_kv = self_kv[i] + l * 2 * H * slots1 * dk;
            for (int64_t hd = 0; hd < H; hd++) {
                memcpy(layer_kv + (hd * slots1 + pos[i]) * dk, qkv + i * 3 * I + I + hd * dk,
                       (size_t)dk * sizeof(float));
                memcpy(layer_kv + ((H + hd) * slots1 + pos[i]) * dk,
                       qkv + i * 3 * I + 2 * I + hd * dk, (size_t)dk * sizeof(float));
            }
        }
        for (int64_t i = 0; i < q;) {
            /* Consecutive rows on one cache (a verification's positions) attend together. */
            int64_t p = 1;
            while (i + p < q && p < ATT_ROWS && self_kv[i + p] == self_kv[i]) p++;
            const float *layer_kv = self_kv[i] + l * 2 * H * slots1 * dk;
            /* Keys after the query are masked by dec_bias (weight exactly 0): not read. */
            int64_t keys[ATT_ROWS];
            for (int64_t r = 0; r < p; r++)
                keys[r] = pos[i + r] + 1 < span ? pos[i + r] + 1 : span;
            for (int64_t hd = 0; hd < H; hd++) {
                const float *bias[ATT_ROWS];
                for (int64_t r = 0; r < p; r++)
                    bias[r] = dec_bias + (hd * span + pos[i + r]) * span;
                attend_rows(qkv + i * 3 * I + hd * dk, 3 * I, layer_kv + hd * slots1 * dk,
                            layer_kv + (H + hd) * slots1 * dk, bias, keys, p, dk, scores, widest,
                            att + i * I + hd * dk, I);
            }
            i += p;
        }
        linear(m, LAYER_LIN(m, o, l), att, h, D, I, q, D, qs);
        for (int64_t i = 0; i < q * D; i++) x[i] += h[i];
        /* cross-attention over each row's encoder K/V */
        for (int64_t i = 0; i < q; i++)
            rms_norm(x + i * D, m->ln_cross[l], h + i * D, D, m->eps);
        linear(m, LAYER_LIN(m, cq, l), h, qkv, I, D, q, I, qs);
        for (int64_t i = 0; i < q;) {
            int64_t p = 1;
            while (i + p < q && p < ATT_ROWS && cross_kv[i + p] == cross_kv[i]
                   && cross[i + p] == cross[i] && cross_bias[i + p] == cross_bias[i])
                p++;
            const float *ckv = cross_kv[i] + l * 2 * H * cross[i] * dk;
            const int64_t unmasked_keys = unmasked(cross_bias[i], cross[i]);
            int64_t keys[ATT_ROWS];
            const float *bias[ATT_ROWS];
            for (int64_t r = 0; r < p; r++) {
                keys[r] = unmasked_keys;
                bias[r] = cross_bias[i];
            }
            for (int64_t hd = 0; hd < H; hd++)
                attend_rows(qkv + i * I + hd * dk, I, ckv + hd * cross[i] * dk,
                            ckv + (H + hd) * cross[i] * dk, bias, keys, p, dk, scores, widest,
                            att + i * I + hd * dk, I);
            i += p;
        }
        linear(m, LAYER_LIN(m, co, l), att, h, D, I, q, D, qs);
        for (int64_t i = 0; i < q * D; i++) x[i] += h[i];
        /* feed-forward */
        for (int64_t i = 0; i < q; i++) rms_norm(x + i * D, m->ln_ff[l], h + i * D, D, m->eps);
        linear(m, LAYER_LIN(m, wi, l), h, u, ff, D, q, ff, qs);
        /* Row i's d_ff activations go to u + i * d_ff (a gated row is twice as wide: the
         * destination never passes the source, so in place is safe). */
        if (!m->gated && m->act == ACT_RELU) {
            /* activate's ReLU as one loop the compiler vectorizes (a NaN or -0 gives 0 as
             * there): a call and a switch per value cost more than the products' share */
            for (int64_t j = 0; j < q * m->d_ff; j++) u[j] = u[j] > 0.0f ? u[j] : 0.0f;
        } else {
            for (int64_t i = 0; i < q; i++) {
                const float *ui = u + i * ff;
                float *vi = u + i * m->d_ff;
                for (int64_t j = 0; j < m->d_ff; j++)
                    vi[j] = m->gated ? activate(ui[j], m->act) * ui[m->d_ff + j]
                                     : activate(ui[j], m->act);
            }
        }
        linear(m, LAYER_LIN(m, wo, l), u, h, D, m->d_ff, q, D, qs);
        for (int64_t i = 0; i < q * D; i++) x[i] += h[i];
    }
    for (int64_t i = 0; i < q; i++) {
        rms_norm(x + i * D, m->final_ln, h + i * D, D, m->eps);
        for (int64_t j = 0; j < D; j++) h[i * D + j] *= m->out_scale;
    }
    const Lin head = m->wmode == W_FLOAT
                         ? (Lin){m->lm_head, 0, 0, 0, 0}
                         : (Lin){0, m->lm_head_q, m->lm_head_s, m->lm_head_c, m->lm_head_p};
    linear(m, head, h, logits, m->vocab, D, q, m->vocab, qs);
    if (logits_out) memcpy(logits_out, logits, (size_t)(q * m->vocab) * sizeof(float));
    for (int64_t i = 0; i < q; i++) {
        const float *li = logits + i * m->vocab;
        int64_t best = 0;
        for (int64_t v = 1; v < m->vocab; v++)
            if (li[v] > li[best]) best = v;
        out[i] = best;
    }
}

/* Y [q, rows] = X [q, n] W [rows, n]^T through the step's own float products (gemm): the
 * products alone, which bench.batch_step sets against torch.mm on the same shapes. */
void tw_gemm(const float *W, const float *X, float *Y, int64_t rows, int64_t n, int64_t q) {
    gemm(W, X, Y, rows, n, q, rows);
}

/* Whether the int8 products read weights repacked at bind (Model's `_p` fields): engine.native
 * makes them only for a build that has the repacked layout (VNNI). */
int64_t tw_q8_packed(void) { return DW == 64; }

/* The queries attend_rows takes at once: engine.native sizes the scratch's score rows by it. */
int64_t tw_att_rows(void) { return ATT_ROWS; }

/* Why an entry point refused a call (engine/native.py names the argument in its error).
 * Checked before anything is written: a refused call leaves every cache as it was. */
enum { TW_OK = 0, TW_BAD_TOKEN = 1, TW_BAD_POSITION = 2, TW_BAD_SPAN = 3, TW_BAD_SIZE = 4 };

/* Rows pos0 .. pos0 + rows - 1 are written into the cache (slots1 slots) and read from
 * dec_bias (span rows): both must hold them; every token id must index the embedding. */
static int64_t check_call(const Model *m, const int64_t *tokens, int64_t ntokens, int64_t rows,
                          int64_t pos0, int64_t slots1, int64_t cross, int64_t span) {
    if (rows < 1 || slots1 < 1 || cross < 1 || span < 1) return TW_BAD_SIZE;
    for (int64_t i = 0; i < ntokens; i++)
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return TW_BAD_TOKEN;
    /* Written as pos0 > limit - rows: pos0 + rows could overflow. */
    if (pos0 < 0 || pos0 > slots1 - rows) return TW_BAD_POSITION;
    if (pos0 > span - rows) return TW_BAD_SPAN;
    return TW_OK;
}

/* The rows of a batched step, each on its own caches: row i's position is written into its
 * cache (slots1 slots) and reads dec_bias row pos[i] (span rows); its token indexes the
 * embedding; its cross K/V is non-empty. Return TW_OK, or why, with the first refused row
 * in *row (-1: the call's sizes). */
static int64_t check_rows(const Model *m, const int64_t *tokens, int64_t q, const int64_t *pos,
                          int64_t slots1, const int64_t *cross, int64_t span, int64_t *row) {
    *row = -1;
    if (q < 1 || slots1 < 1 || span < 1) return TW_BAD_SIZE;
    for (int64_t i = 0; i < q; i++) {
        *row = i;
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return TW_BAD_TOKEN;
        if (pos[i] < 0 || pos[i] >= slots1) return TW_BAD_POSITION;
        if (pos[i] >= span) return TW_BAD_SPAN;
        if (cross[i] < 1) return TW_BAD_SIZE;
    }
    *row = -1;
    return TW_OK;
}

/* Decode `q` rows on their own caches (see rows); return TW_OK, or why the call was refused:
 * then no cache is written and out[0] is the first refused row (-1: the call's sizes). */
int64_t tw_rows(const Model *m, const int64_t *tokens, int64_t q, const int64_t *pos,
                float *const *self_kv, int64_t slots1, const float *const *cross_kv,
                const int64_t *cross, const float *const *cross_bias, const float *dec_bias,
                int64_t span, float *scratch, int64_t *out, float *logits_out) {
    int64_t row;
    const int64_t why = check_rows(m, tokens, q, pos, slots1, cross, span, &row);
    if (why != TW_OK) {
        if (q >= 1) out[0] = row;
        return why;
    }
    rows(m, tokens, q, pos, self_kv, slots1, cross_kv, cross, cross_bias, dec_bias, span,
         scratch, out, logits_out);
    return TW_OK;
}

/* Decode `q` tokens of one request at positions pos0 .. pos0 + q - 1 (q = 1: a direct
 * step; q > 1: a speculative verification): rows with every row on the same caches.
 * Unchecked: the entry points check first. */
static void decode(const Model *m, const int64_t *tokens, int64_t q, int64_t pos0,
                   float *self_kv, int64_t slots1, const float *cross_kv, int64_t cross,
                   const float *cross_bias, const float *dec_bias, int64_t span,
                   float *scratch, int64_t *out) {
    int64_t pos[q], lens[q];
    float *kv[q];
    const float *ckv[q], *cb[q];
    for (int64_t i = 0; i < q; i++) {
        pos[i] = pos0 + i;
        kv[i] = self_kv;
        ckv[i] = cross_kv;
        lens[i] = cross;
        cb[i] = cross_bias;
    }
    rows(m, tokens, q, pos, kv, slots1, ckv, lens, cb, dec_bias, span, scratch, out, 0);
}

/* Decode `q` tokens at positions pos0 .. pos0 + q - 1 (see decode); return TW_OK, or why
 * the call was refused (then nothing is written). */
int64_t tw_decode(const Model *m, const int64_t *tokens, int64_t q, int64_t pos0,
                  float *self_kv, int64_t slots1, const float *cross_kv, int64_t cross,
                  const float *cross_bias, const float *dec_bias, int64_t span, float *scratch,
                  int64_t *out) {
    const int64_t why = check_call(m, tokens, q, q, pos0, slots1, cross, span);
    if (why != TW_OK) return why;
    decode(m, tokens, q, pos0, self_kv, slots1, cross_kv, cross, cross_bias, dec_bias, span,
           scratch, out);
    return TW_OK;
}

/* Decode `steps` tokens greedily from `token` at positions pos0 .. pos0 + steps - 1, each
 * step's choice the next step's input (a draft's proposals for one round): out[i] is the
 * greedy token after out[i - 1]. The same arithmetic as `steps` calls of tw_decode, without
 * a call from Python per token (at a small draft's size that call costs more than the
 * step's own arithmetic). */
int64_t tw_chain(const Model *m, int64_t token, int64_t steps, int64_t pos0, float *self_kv,
                 int64_t slots1, const float *cross_kv, int64_t cross, const float *cross_bias,
                 const float *dec_bias, int64_t span, float *scratch, int64_t *out) {
    /* Every step's position checked up front: a refused round writes no step at all. Later
     * tokens are argmaxes over the vocabulary, in range by construction. */
    const int64_t why = check_call(m, &token, 1, steps, pos0, slots1, cross, span);
    if (why != TW_OK) return why;
    for (int64_t i = 0; i < steps; i++) {
        const int64_t tok = i == 0 ? token : out[i - 1];
        decode(m, &tok, 1, pos0 + i, self_kv, slots1, cross_kv, cross, cross_bias, dec_bias,
               span, scratch, out + i);
    }
    return TW_OK;
}
