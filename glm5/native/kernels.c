/* glm5 native CPU kernels (fp32), compiled on first use by glm5/native/__init__.py and called through
 * ctypes. Each kernel has a PyTorch reference it is tested against (tests/test_native.py):
 *
 *   glm5_moe           routed experts of one MoE layer  == glm5.model.moe.grouped_experts
 *   glm5_latent_decode dense absorbed-MLA attention     == glm5.model.latent_attention.dense_latent_attention
 *   glm5_mla_decode    the same with W_uk and W_uv      == MLAttention.absorb_q / .latent_to_heads around it
 *   glm5_gqa_decode    GQA over paged [k | v] rows      == glm5.model.gqa_attention.GQAttention._attend_group
 *   glm5_gqa_prefill   the same, a first chunk (causal)  == GQAttention._attend_group (causal_from_start)
 *   glm5_rope          rotary embedding                 == glm5.model.layers.apply_rope
 *   glm5_rope_heads    the same in place on head rows   == GQAttention._rotate (half-split, partial)
 *   glm5_rms_norm      RMSNorm, fp32                    == glm5.model.layers.RMSNorm
 *   glm5_linear        a few rows through a linear layer == torch.nn.functional.linear
 *   glm5_linear_int8   the same, int8 weight + scales   == glm5.infer.quant.Int8Linear
 *   glm5_swiglu        SwiGLU MLP (dense, shared expert) == glm5.model.layers.SwiGLU
 *   glm5_route         the MoE router                   == glm5.model.moe.Router
 *   glm5_decode_layer  a decoder layer at decode         == glm5.model.model.DecoderLayer (paged, no selection)
 *
 * Why native: at decode sizes the first three are memory-bound loops over small products (a few rows per
 * expert, 6-head latent attention) where per-call BLAS overhead, gathers and temporaries cost more than the
 * arithmetic, and the last two are composites of ~10 PyTorch ops each. Here every weight / key row is read
 * once, in memory order where it matters, with the partial results kept in L1.
 *
 * Threads: OpenMP, sharing the runtime PyTorch already loaded (libgomp.so.1), so the kernels run on the
 * same pool as torch's own ops instead of competing with its spinning workers.
 * Vectors: GCC vector extensions (8 floats); the compiler maps them to AVX2/AVX-512/NEON as -march allows.
 * Where it targets AVX-512, the GEMM's register tiles are 16-float vectors, 32 columns wide (tile32).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

/* exp of 8 floats: Cephes' expf polynomial after the range reduction x = n ln2 + r, |r| <= ln2 / 2; about
 * 1 ulp. Inputs are clamped to [-87.3, 88]: below, exp(-87.3) ~ 1e-38 stands for 0; above, 1.7e38 for inf. */
static inline v8 exp8(v8 x) {
    const v8 lo = (v8){0} - 87.3f, hi = (v8){0} + 88.0f;
    vi8 small = x < lo, big = x > hi;
    x = (v8)(((vi8)x & ~small) | ((vi8)lo & small));
    x = (v8)(((vi8)x & ~big) | ((vi8)hi & big));
    v8 t = x * 1.44269504088896341f + 12582912.0f; /* round(x / ln2) in the low mantissa bits */
    vi8 n = (vi8)t - 0x4B400000;
    v8 nf = t - 12582912.0f;
    v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v8 y = p * r * r + r + 1.0f;
    return (v8)((vi8)y + (n << 23));
}

/* small_gemm's regimes by rows R sharing a weight (an expert's rows), measured on the bench checkpoint:
 * R <= LIN_ROWS: one weight row at a time, in memory order (a pure stream: 14-17 GB/s on one core here,
 * against 11-12 reading four rows at a time); up to TILE_ROWS: four weight rows at a time over K_CHUNK-row
 * chunks (read from memory once, from cache for the other row blocks); from TILE_ROWS: TILE_M x 16 register
 * tiles (arithmetic-bound). */
#define LIN_ROWS 6
#define TILE_ROWS 12
#define TILE_M 8
_Static_assert(TILE_M == 8, "row tiles are dispatched by UPTO8");
#define K_CHUNK 64
#define PREFETCH_ROWS 8 /* weight rows ahead of the one being read (four-row form) */
#define KEYS_AHEAD 8    /* attention: key rows ahead of the one being scored whose lines are prefetched
                         * (GQA decode, 64 sequences x 160 keys, 1 thread: none 4.1 ms, 4 ahead 1.04, 8 0.77,
                         * 16 0.96; docs/bench-engine.md, "2026-12-07 night") */

/* f(args..., k) with k the compile-time constant min(n, 6); n must be >= 1 (n = 0 would run 6). Kernels
 * below unroll their loops over a constant number of rows or heads. */
#define UPTO6(n, f, ...)                        \
    switch ((n) < 6 ? (n) : 6) {                \
        case 1: f(__VA_ARGS__, 1); break;       \
        case 2: f(__VA_ARGS__, 2); break;       \
        case 3: f(__VA_ARGS__, 3); break;       \
        case 4: f(__VA_ARGS__, 4); break;       \
        case 5: f(__VA_ARGS__, 5); break;       \
        default: f(__VA_ARGS__, 6); break;      \
    }

/* The same for row tiles: f(args..., k) with k = min(n, 8) (TILE_M = WIDE_M = 8); n >= 1. */
#define UPTO8(n, f, ...)                        \
    switch ((n) < 8 ? (n) : 8) {                \
        case 1: f(__VA_ARGS__, 1); break;       \
        case 2: f(__VA_ARGS__, 2); break;       \
        case 3: f(__VA_ARGS__, 3); break;       \
        case 4: f(__VA_ARGS__, 4); break;       \
        case 5: f(__VA_ARGS__, 5); break;       \
        case 6: f(__VA_ARGS__, 6); break;       \
        case 7: f(__VA_ARGS__, 7); break;       \
        default: f(__VA_ARGS__, 8); break;      \
    }

/* Y[0:RR, :] += X[0:RR, k:k+4] @ W[k:k+4, :] for a compile-time RR: four weight rows read once per vector,
 * each input row's four coefficients held in registers. */
static inline __attribute__((always_inline)) void quad(const float *X, long ldx, int k, const float *W, long ldw,
                                                       int N, float *Y, const int RR) {
    const float *w0 = W + (long)k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    const long ahead = PREFETCH_ROWS * ldw;
    float b[4][4];
    for (int r = 0; r < RR; r++)
        for (int q = 0; q < 4; q++) b[r][q] = X[r * ldx + k + q];
    int nv = N / 8 * 8, j = 0;
    for (; j < nv; j += 8) {
        if ((j & 15) == 0) {
            __builtin_prefetch(w0 + j + ahead);
            __builtin_prefetch(w1 + j + ahead);
            __builtin_prefetch(w2 + j + ahead);
            __builtin_prefetch(w3 + j + ahead);
        }
        v8 a0 = *(const v8 *)(w0 + j), a1 = *(const v8 *)(w1 + j), a2 = *(const v8 *)(w2 + j),
           a3 = *(const v8 *)(w3 + j);
        for (int r = 0; r < RR; r++) {
            v8 acc = *(v8 *)(Y + r * (long)N + j);
            acc += b[r][0] * a0;
            acc += b[r][1] * a1;
            acc += b[r][2] * a2;
            acc += b[r][3] * a3;
            *(v8 *)(Y + r * (long)N + j) = acc;
        }
    }
    for (; j < N; j++)
        for (int r = 0; r < RR; r++)
            Y[r * (long)N + j] += b[r][0] * w0[j] + b[r][1] * w1[j] + b[r][2] * w2[j] + b[r][3] * w3[j];
}

/* Y[0:RR, j:j+16] = X[0:RR, :] @ W[:, j:j+16] for a compile-time RR <= 6: 2 * RR accumulators in registers
 * over the whole K loop (the register-blocked kernel for many rows; the [K, 16] weight panel stays in L1
 * across the row blocks that reuse it). */
static inline __attribute__((always_inline)) void tile16(const float *X, long ldx, int K, const float *W, long ldw,
                                                         float *Y, long ldy, const int RR) {
    v8 a0[TILE_M], a1[TILE_M];
    for (int r = 0; r < RR; r++) a0[r] = a1[r] = (v8){0};
    for (int k = 0; k < K; k++, W += ldw) {
        v8 w0 = *(const v8 *)W, w1 = *(const v8 *)(W + 8);
        for (int r = 0; r < RR; r++) {
            float b = X[r * ldx + k];
            a0[r] += b * w0;
            a1[r] += b * w1;
        }
    }
    for (int r = 0; r < RR; r++) {
        *(v8 *)(Y + r * ldy) = a0[r];
        *(v8 *)(Y + r * ldy + 8) = a1[r];
    }
}

/* Y[0:RR, :] += X[0:RR, :] @ W for a compile-time RR <= 6, one weight row at a time (in memory order). */
static inline __attribute__((always_inline)) void lin_rows(const float *X, long ldx, int K, const float *W, long ldw,
                                                           int N, float *Y, const int RR) {
    int nv = N / 8 * 8;
    for (int k = 0; k < K; k++) {
        const float *w = W + (long)k * ldw;
        float b[6];
        for (int r = 0; r < RR; r++) b[r] = X[r * ldx + k];
        int j = 0;
        for (; j < nv; j += 8) {
            v8 x = *(const v8 *)(w + j);
            for (int r = 0; r < RR; r++) *(v8 *)(Y + r * (long)N + j) += b[r] * x;
        }
        for (; j < N; j++)
            for (int r = 0; r < RR; r++) Y[r * (long)N + j] += b[r] * w[j];
    }
}

#ifdef __AVX512F__
/* 16 floats: one AVX-512 register (declared only where the compiler targets AVX-512: on AVX2 a tile of these
 * would not fit the 16 vector registers). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define WIDE_M 8 /* rows per wide tile (16 accumulators): 8 and 12 equal at 128 rows an expert, 8 faster at 16 */
_Static_assert(WIDE_M == 8, "wide tiles are dispatched by UPTO8");

/* tile16 for 32 columns of AVX-512 vectors and a compile-time RR <= WIDE_M: each output element is the same
 * sum, in the same order (k ascending), as tile16 forms it. On the bench's expert shapes (1 thread, Zen 5)
 * twice tile16's rate: the weight panel is read once per 2 * RR vector products instead of per RR. */
static inline __attribute__((always_inline)) void tile32(const float *X, long ldx, int K, const float *W, long ldw,
                                                         float *Y, long ldy, const int RR) {
    v16 a0[WIDE_M], a1[WIDE_M];
    for (int r = 0; r < RR; r++) a0[r] = a1[r] = (v16){0};
    for (int k = 0; k < K; k++, W += ldw) {
        v16 w0 = *(const v16 *)W, w1 = *(const v16 *)(W + 16);
        for (int r = 0; r < RR; r++) {
            float b = X[r * ldx + k];
            a0[r] += b * w0;
            a1[r] += b * w1;
        }
    }
    for (int r = 0; r < RR; r++) {
        *(v16 *)(Y + r * ldy) = a0[r];
        *(v16 *)(Y + r * ldy + 16) = a1[r];
    }
}

/* Columns 0 .. 32 * (N / 32) of Y by wide tiles; returns the first column left. */
static int wide_panels(const float *X, long ldx, int R, int K, const float *W, long ldw, int N, float *Y) {
    int nt = N / 32 * 32;
    for (int j = 0; j < nt; j += 32)
        for (int r0 = 0; r0 < R; r0 += WIDE_M) {
            const float *x = X + r0 * ldx;
            float *y = Y + r0 * (long)N + j;
            UPTO8(R - r0, tile32, x, ldx, K, W + j, ldw, y, N);
        }
    return nt;
}
#endif

/* Y[R, N] = X[R, K] @ W[K, N] for many rows (R >= TILE_ROWS): register tiles, column panel by column panel
 * (TILE_M x 16, or WIDE_M x 32 where the compiler targets AVX-512). */
static void tiled_gemm(const float *X, long ldx, int R, int K, const float *W, long ldw, int N, float *Y) {
    int j0 = 0;
#ifdef __AVX512F__
    j0 = wide_panels(X, ldx, R, K, W, ldw, N, Y);
#endif
    int nt = j0 + (N - j0) / 16 * 16;
    for (int j = j0; j < nt; j += 16)
        for (int r0 = 0; r0 < R; r0 += TILE_M) {
            const float *x = X + r0 * ldx;
            float *y = Y + r0 * (long)N + j;
            UPTO8(R - r0, tile16, x, ldx, K, W + j, ldw, y, N);
        }
    for (int r = 0; r < R; r++)
        for (int j = nt; j < N; j++) {
            float acc = 0;
            for (int k = 0; k < K; k++) acc += X[r * ldx + k] * W[(long)k * ldw + j];
            Y[r * (long)N + j] = acc;
        }
}

/* Columns per register tile of tiled_gemm as compiled here: 32 with AVX-512 (wide tiles), else 16. The engine
 * reads it to choose the routed experts' path for prefill-sized steps (glm5/infer/kernels.py). */
int glm5_gemm_width(void) {
#ifdef __AVX512F__
    return 32;
#else
    return 16;
#endif
}

/* Y[R, N] = X[R, K] @ W[K, N] (X rows ldx apart, W rows ldw apart, Y contiguous), in the regime R calls for
 * (see LIN_ROWS above): few rows (decode) are bound by reading W, many by arithmetic. */
static void small_gemm(const float *X, long ldx, int R, int K, const float *W, long ldw, int N, float *Y) {
    if (R <= 0)
        return;
    if (R >= TILE_ROWS) {
        tiled_gemm(X, ldx, R, K, W, ldw, N, Y);
        return;
    }
    memset(Y, 0, sizeof(float) * (long)R * N);
    if (R <= LIN_ROWS) {
        UPTO6(R, lin_rows, X, ldx, K, W, ldw, N, Y);
        return;
    }
    for (int k0 = 0; k0 < K; k0 += K_CHUNK) {
        int k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
        for (int r0 = 0; r0 < R; r0 += 4) {
            int rb = R - r0 < 4 ? R - r0 : 4;
            const float *x = X + r0 * ldx;
            float *y = Y + r0 * (long)N;
            int k = k0;
            for (; k + 4 <= k1; k += 4) {
                switch (rb) {
                    case 1: quad(x, ldx, k, W, ldw, N, y, 1); break;
                    case 2: quad(x, ldx, k, W, ldw, N, y, 2); break;
                    case 3: quad(x, ldx, k, W, ldw, N, y, 3); break;
                    default: quad(x, ldx, k, W, ldw, N, y, 4); break;
                }
            }
            for (; k < k1; k++)
                for (int r = 0; r < rb; r++) {
                    float c = x[r * ldx + k];
                    const float *w = W + (long)k * ldw;
                    for (int j = 0; j < N; j++) y[r * (long)N + j] += c * w[j];
                }
        }
    }
}

static inline int n_threads(int want) {
#ifdef _OPENMP
    return want > 1 ? want : 1;
#else
    (void)want;
    return 1;
#endif
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* ---------------------------------------------------------------------------------------------------- */
/* Routed experts                                                                                        */

typedef struct {
    const float *x, *w, *gu, *dn;
    const int64_t *token, *offs;
    float *ys;
    long gu_es, dn_es;
    int H, I, A;
} moe_args;

/* Experts e0..e1-1: gather their rows, gate_up GEMM, SwiGLU, down GEMM, scale by the routing weight, into
 * ys rows (sorted order). Returns 0, or 1 when a buffer could not be allocated. */
static int moe_experts(const moe_args *a, int e0, int e1) {
    const int H = a->H, I = a->I;
    long maxr = 0;
    for (int e = e0; e < e1; e++)
        if (a->offs[e + 1] - a->offs[e] > maxr) maxr = a->offs[e + 1] - a->offs[e];
    if (!maxr) return 0;
    float *xb = malloc(sizeof(float) * maxr * (H + 3L * I));
    if (!xb) return 1;
    float *hb = xb + maxr * H, *ab = hb + maxr * 2 * I;
    for (int e = e0; e < e1; e++) {
        long lo = a->offs[e], R = a->offs[e + 1] - lo;
        if (!R) continue;
        for (long r = 0; r < R; r++) memcpy(xb + r * H, a->x + (a->token[lo + r] / a->A) * H, sizeof(float) * H);
        small_gemm(xb, H, (int)R, H, a->gu + e * a->gu_es, 2L * I, 2 * I, hb);
        for (long r = 0; r < R; r++) {
            const float *g = hb + r * 2 * I, *u = g + I;
            float *act = ab + r * I;
            int i = 0;
            for (; i + 8 <= I; i += 8) {
                v8 gv = *(const v8 *)(g + i);
                *(v8 *)(act + i) = gv / (1.0f + exp8(-gv)) * *(const v8 *)(u + i);
            }
            for (; i < I; i++) act[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        float *y = a->ys + lo * H;
        small_gemm(ab, I, (int)R, I, a->dn + e * a->dn_es, H, H, y);
        for (long r = 0; r < R; r++) {
            float s = a->w[a->token[lo + r]];
            for (int h = 0; h < H; h++) y[r * H + h] *= s;
        }
    }
    free(xb);
    return 0;
}

/* out[N, H] = sum over each token's A routed experts of w * SwiGLU_e(x), for x [N, H], idx / w [N, A]
 * (int64 expert ids, fp32 weights: 0 for a dropped assignment), expert e's gate_up weight [H, 2I] (gate
 * columns first) at gu + e * gu_es and down weight [I, H] at dn + e * dn_es, both row-major ([in, out]).
 * Assignments are grouped by expert (stable, token order kept) and each token's terms are added in expert
 * order, as `grouped_experts` does. Returns 0; 2 for an expert id out of [0, E); 3 for A > 64; 1 when out
 * of memory. */
int glm5_moe(const float *x, long N, int H, const int64_t *idx, const float *w, int A, int E, int I,
             const float *gu, long gu_es, const float *dn, long dn_es, float *out, int threads) {
    long M = N * A;
    if (A > 64) return 3;
    for (long m = 0; m < M; m++)
        if (idx[m] < 0 || idx[m] >= E) return 2;
    int64_t *offs = calloc(E + 1, sizeof(int64_t));
    int64_t *sorted = malloc(sizeof(int64_t) * (M ? M : 1)); /* flat assignment index n*A+j, by expert */
    int64_t *pos = malloc(sizeof(int64_t) * (M ? M : 1));    /* flat assignment -> its sorted row */
    float *ys = malloc(sizeof(float) * (M ? M : 1) * H);
    int bad = !offs || !sorted || !pos || !ys;
    if (!bad) {
        for (long m = 0; m < M; m++) offs[idx[m] + 1]++;
        for (int e = 0; e < E; e++) offs[e + 1] += offs[e];
        int64_t *fill = malloc(sizeof(int64_t) * (E ? E : 1));
        bad = !fill;
        if (fill) {
            memcpy(fill, offs, sizeof(int64_t) * E);
            for (long m = 0; m < M; m++) {
                int64_t p = fill[idx[m]]++;
                sorted[p] = m;
                pos[m] = p;
            }
            free(fill);
        }
    }
    if (!bad) {
        moe_args a = {x, w, gu, dn, sorted, offs, ys, gu_es, dn_es, H, I, A};
        /* split the experts into contiguous ranges of about equal cost: reading an expert's weights (~4
         * rows' worth of work at decode sizes) plus one unit per row */
        int T = n_threads(threads);
        double total = 0;
        for (int e = 0; e < E; e++)
            if (offs[e + 1] > offs[e]) total += 4.0 + (double)(offs[e + 1] - offs[e]);
        if (total < 16) T = 1; /* a few experts: not worth waking a second thread */
        int bounds[65];
        if (T > 64) T = 64;
        bounds[0] = 0;
        double acc = 0;
        int e = 0;
        for (int t = 1; t < T; t++) {
            while (e < E && acc < total * t / T) {
                if (offs[e + 1] > offs[e]) acc += 4.0 + (double)(offs[e + 1] - offs[e]);
                e++;
            }
            bounds[t] = e;
        }
        bounds[T] = E;
        int fail = 0;
        if (T == 1) {
            fail = moe_experts(&a, 0, E);
        } else {
#pragma omp parallel num_threads(T) reduction(| : fail)
            {
                int t = thread_id();
                fail |= moe_experts(&a, bounds[t], bounds[t + 1]);
            }
        }
        bad = fail;
        if (!bad) { /* each token: its terms in sorted (expert) order, added to zero one by one */
#pragma omp parallel for num_threads(T) schedule(static) if (T > 1)
            for (long n = 0; n < N; n++) {
                int64_t p[64];
                for (int j = 0; j < A; j++) { /* insertion sort of the A <= 64 positions */
                    int64_t v = pos[n * A + j];
                    int i = j;
                    while (i > 0 && p[i - 1] > v) { p[i] = p[i - 1]; i--; }
                    p[i] = v;
                }
                float *o = out + n * H;
                memset(o, 0, sizeof(float) * H);
                for (int j = 0; j < A; j++) {
                    const float *y = ys + p[j] * H;
                    for (int h = 0; h < H; h++) o[h] += y[h];
                }
            }
        }
    }
    free(offs);
    free(sorted);
    free(pos);
    free(ys);
    return bad ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Dense absorbed-MLA attention over paged latent rows                                                   */

/* d[h * ld] = q[h] . row for a compile-time number of heads HB <= 6 (HB accumulators in registers; the key
 * row is read once for all of them). */
static inline __attribute__((always_inline)) void head_dots(const float *q, int W, const float *row, float *d,
                                                            long ld, const int HB) {
    v8 acc[6];
    for (int h = 0; h < HB; h++) acc[h] = (v8){0};
    int wv = W / 8 * 8, j = 0;
    for (; j < wv; j += 8) {
        v8 x = *(const v8 *)(row + j);
        for (int h = 0; h < HB; h++) acc[h] += *(const v8 *)(q + (long)h * W + j) * x;
    }
    for (int h = 0; h < HB; h++) {
        float s = 0;
        for (int l = 0; l < 8; l++) s += acc[h][l];
        for (int jj = j; jj < W; jj++) s += q[(long)h * W + jj] * row[jj];
        d[h * ld] = s;
    }
}

/* o[h] += p[h * ld] * r0 + p[h * ld + 1] * r1 over R columns for HB <= 6 heads: each row vector loaded once
 * for all heads, the 2 * HB weights in registers (r1's weight is 0 when `two` is false). */
static inline __attribute__((always_inline)) void head_accum2(float *o, int R, const float *r0, const float *r1,
                                                              const float *p, long ld, int two, const int HB) {
    float p0[6], p1[6];
    for (int h = 0; h < HB; h++) {
        p0[h] = p[h * ld];
        p1[h] = two ? p[h * ld + 1] : 0.0f;
    }
    int rv = R / 8 * 8, j = 0;
    for (; j < rv; j += 8) {
        v8 x0 = *(const v8 *)(r0 + j), x1 = *(const v8 *)(r1 + j);
        for (int h = 0; h < HB; h++) *(v8 *)(o + (long)h * R + j) += p0[h] * x0 + p1[h] * x1;
    }
    for (; j < R; j++)
        for (int h = 0; h < HB; h++) o[(long)h * R + j] += p0[h] * r0[j] + p1[h] * r1[j];
}

/* One query row (all H heads) over its sequence's first n keys. qs [H, W] scaled queries; key s is the W
 * values at lat + slots[s] * ldr, its value the R values voff further on (MLA: ldr = W, voff = 0, the value is
 * the key row's latent part; GQA: one key/value head's two halves of a cache row); sc [H, ld] and
 * keys [ld] scratch; o [H, R] output. Only allowed keys (bias > -inf) are read: their indices are listed
 * first, then scored two rows at a time, and the output accumulated four rows at a time (each pass reads a
 * row once for all heads). With `given` (K key indices, -1 = none: a top-k selection of allowed keys) only
 * those keys are attended. */
static void latent_row(const float *qs, int H, int W, const float *lat, long ldr, long voff, const int64_t *slots,
                       long n, const float *bias, const int64_t *given, long K, int R, float *sc, int64_t *keys,
                       long ld, float *o) {
    long m = 0;
    if (given) {
        for (long k = 0; k < K; k++)
            if (given[k] >= 0) keys[m++] = given[k];
    } else {
        for (long s = 0; s < n; s++)
            if (bias[s] != -INFINITY) keys[m++] = s;
    }
    memset(o, 0, sizeof(float) * H * R);
    if (!m) return; /* a row with no allowed key: zeros */
    for (long i = 0; i < m; i++) { /* one key row at a time: a pure stream through the sequence's blocks */
        const float *row = lat + slots[keys[i]] * ldr;
        if (i + KEYS_AHEAD < m) { /* rows are scattered over blocks: ask for a later key's key and value now */
            const char *ahead = (const char *)(lat + slots[keys[i + KEYS_AHEAD]] * ldr);
            for (long b = 0; b < (long)W * 4; b += 64) __builtin_prefetch(ahead + b);
            if (voff) /* GQA: the value lies apart from the key (MLA's value is the key row's latent part) */
                for (long b = 0; b < (long)R * 4; b += 64) __builtin_prefetch(ahead + voff * 4 + b);
        }
        for (int h0 = 0; h0 < H; h0 += 6)
            UPTO6(H - h0, head_dots, qs + (long)h0 * W, W, row, sc + h0 * ld + i, ld);
    }
    for (int h = 0; h < H; h++) { /* softmax over the allowed keys, in place */
        float *p = sc + h * ld, mx = -INFINITY, z = 0;
        for (long i = 0; i < m; i++) {
            p[i] += bias[keys[i]];
            mx = p[i] > mx ? p[i] : mx;
        }
        long i = 0;
        v8 zv = {0};
        for (; i + 8 <= m; i += 8) {
            v8 e = exp8(*(v8 *)(p + i) - mx);
            *(v8 *)(p + i) = e;
            zv += e;
        }
        for (; i < m; i++) z += (p[i] = expf(p[i] - mx));
        for (int l = 0; l < 8; l++) z += zv[l];
        float inv = 1.0f / z;
        for (i = 0; i < m; i++) p[i] *= inv;
    }
    for (long i = 0; i < m; i += 2) {
        const float *r0 = lat + slots[keys[i]] * ldr + voff, *r1 = i + 1 < m ? lat + slots[keys[i + 1]] * ldr + voff : r0;
        for (int h0 = 0; h0 < H; h0 += 6) {
            const float *p = sc + h0 * ld + i;
            float *oh = o + (long)h0 * R;
            int two = i + 1 < m;
            UPTO6(H - h0, head_accum2, oh, R, r0, r1, p, ld, two);
        }
    }
}

/* Absorbed MLA end to end (`glm5_mla_decode`): each query row's latent query is formed here from q_nope
 * through W_uk, and its latent output taken through W_uv, both read from the kv_b_proj weight. */
typedef struct {
    const float *q_nope, *q_rope, *kvb; /* q_nope [items, H, E] (strided), q_rope [items, H, P], kvb [H*(E+V), R] */
    long qn_si, qn_sh;                  /* q_nope's item and head strides (its last dim is contiguous) */
    int E, V, P;
} absorb_t;

static inline float dot(const float *a, const float *b, int n) {
    v8 acc = {0};
    int nv = n / 8 * 8, j = 0;
    for (; j < nv; j += 8) acc += *(const v8 *)(a + j) * *(const v8 *)(b + j);
    float s = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* 0 when every sequence's length is in [0, S], its first lens[b] key slots in [0, rows) and each of its T
 * query rows' K selected keys (sel, optional) in [-1, lens[b]); else 2. */
static int keys_ok(long B, long T, long S, const int64_t *slots, const int64_t *lens, long rows, const int64_t *sel,
                   long K) {
    for (long b = 0; b < B; b++) {
        if (lens[b] < 0 || lens[b] > S) return 2;
        for (long s = 0; s < lens[b]; s++)
            if (slots[b * S + s] < 0 || slots[b * S + s] >= rows) return 2;
        for (long k = 0; sel && k < T * K; k++)
            if (sel[b * T * K + k] < -1 || sel[b * T * K + k] >= lens[b]) return 2;
    }
    return 0;
}

/* The query rows of B sequences x T (items i = b * T + t) over their keys; see the entry points, which
 * check the key tables and selections first (keys_ok; a layer's own top-k only picks allowed keys). */
static int latent_items(const float *q, const absorb_t *ab, long B, long T, int H, int W, const float *lat,
                        const int64_t *slots, long S, const float *bias, const int64_t *lens, int R,
                        float scale, const int64_t *sel, long K, float *out, int threads) {
    long items = B * T;
    int nt = n_threads(threads);
    if (nt > items) nt = (int)(items ? items : 1);
    int fail = 0;
#pragma omp parallel num_threads(nt) reduction(| : fail) if (nt > 1)
    {
        long ld = S ? S : 1;
        float *qs = malloc(sizeof(float) * ((long)H * W + (long)H * ld + (long)H * R) + sizeof(int64_t) * ld);
        float *sc = qs ? qs + (long)H * W : NULL, *olat = qs ? sc + (long)H * ld : NULL;
        int64_t *keys = qs ? (int64_t *)(olat + (long)H * R) : NULL;
        fail |= !qs;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < items; i++) { /* every thread takes part in the loop, even without buffers */
            if (!qs) continue;
            long b = i / T;
            if (ab) {
                const int E = ab->E, V = ab->V, P = ab->P;
                for (int h = 0; h < H; h++) {
                    const float *w_uk = ab->kvb + (long)h * (E + V) * R; /* [E, R] */
                    small_gemm(ab->q_nope + i * ab->qn_si + h * ab->qn_sh, E, 1, E, w_uk, R, R, qs + (long)h * W);
                    memcpy(qs + (long)h * W + R, ab->q_rope + (i * H + h) * (long)P, sizeof(float) * P);
                }
                for (long j = 0; j < (long)H * W; j++) qs[j] *= scale;
                latent_row(qs, H, W, lat, W, 0, slots + b * S, lens[b], bias + i * S, sel ? sel + i * K : NULL, K, R, sc,
                           keys, ld, olat);
                for (int h = 0; h < H; h++) {
                    const float *w_uv = ab->kvb + ((long)h * (E + V) + E) * R; /* [V, R] */
                    for (int v = 0; v < V; v++) out[(i * H + h) * V + v] = dot(olat + (long)h * R, w_uv + (long)v * R, R);
                }
            } else {
                const float *qi = q + i * H * W;
                for (long j = 0; j < (long)H * W; j++) qs[j] = qi[j] * scale;
                latent_row(qs, H, W, lat, W, 0, slots + b * S, lens[b], bias + i * S, NULL, 0, R, sc, keys, ld,
                           out + i * H * R);
            }
        }
        free(qs);
    }
    return fail;
}

/* out [B, T, H, R] = softmax(q . k * scale + bias) . k[:R] per head, for queries q [B, T, H, W] over the
 * keys of each sequence b: latent rows lat[slots[b, s]] (lat [rows, W]) for s < lens[b] <= S, with the
 * additive mask bias [B, T, S] (-inf = not allowed; such keys are not read). All contiguous fp32 / int64.
 * Returns 0; 2 for a slot outside [0, rows) or a length outside [0, S]; 1 when out of memory. */
int glm5_latent_decode(const float *q, long B, long T, int H, int W, const float *lat, long rows,
                       const int64_t *slots, long S, const float *bias, const int64_t *lens, int R, float scale,
                       float *out, int threads) {
    if (keys_ok(B, T, S, slots, lens, rows, NULL, 0)) return 2;
    return latent_items(q, NULL, B, T, H, W, lat, slots, S, bias, lens, R, scale, NULL, 0, out, threads);
}

/* The same attention from the un-absorbed query: q_nope [B*T, H, E] (item stride qn_si, head stride qn_sh,
 * last dim contiguous) through W_uk, q_rope [B*T, H, P] contiguous, kvb the kv_b_proj weight [H*(E+V), R]
 * (head h's W_uk rows h*(E+V) .. +E, its W_uv rows the next V); latent rows of width R + P.
 * out [B, T, H, V] = W_uv . attention output. Returns as glm5_latent_decode. */
int glm5_mla_decode(const float *q_nope, long qn_si, long qn_sh, const float *q_rope, const float *kvb, int E,
                    int V, int P, long B, long T, int H, const float *lat, long rows, const int64_t *slots, long S,
                    const float *bias, const int64_t *lens, int R, float scale, float *out, int threads) {
    if (keys_ok(B, T, S, slots, lens, rows, NULL, 0)) return 2;
    absorb_t ab = {q_nope, q_rope, kvb, qn_si, qn_sh, E, V, P};
    return latent_items(NULL, &ab, B, T, H, R + P, lat, slots, S, bias, lens, R, scale, NULL, 0, out, threads);
}

/* Grouped-query attention over paged [k | v] cache rows (GQAttention's decode-sized groups): q [B, T, H, D]
 * with H = G * r query heads (head h reads key/value head h / r), cache rows [rows, 2 * G * D] (G key heads of D
 * values, then G value heads), slots [B, S] / lens [B] / bias [B, T, S] as glm5_latent_decode -> out [B, T, H, D]
 * = softmax(q . k * scale + bias) . v per head. Work items are (query row, key/value head). Returns as
 * glm5_latent_decode. */
int glm5_gqa_decode(const float *q, long B, long T, int H, int G, int D, const float *cache, long rows,
                    const int64_t *slots, long S, const float *bias, const int64_t *lens, float scale, float *out,
                    int threads) {
    if (G <= 0 || H % G) return 3;
    if (keys_ok(B, T, S, slots, lens, rows, NULL, 0)) return 2;
    const int r = H / G;
    const long items = B * T * G, ldr = 2L * G * D;
    int nt = n_threads(threads);
    if (nt > items) nt = (int)(items ? items : 1);
    int fail = 0;
#pragma omp parallel num_threads(nt) reduction(| : fail) if (nt > 1)
    {
        long ld = S ? S : 1;
        float *qs = malloc(sizeof(float) * ((long)r * D + (long)r * ld) + sizeof(int64_t) * ld);
        float *sc = qs ? qs + (long)r * D : NULL;
        int64_t *keys = qs ? (int64_t *)(sc + (long)r * ld) : NULL;
        fail |= !qs;
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            if (!qs) continue;
            long i = it / G, b = i / T;
            int g = (int)(it % G);
            const float *qi = q + (i * H + (long)g * r) * D;
            for (long j = 0; j < (long)r * D; j++) qs[j] = qi[j] * scale;
            latent_row(qs, r, D, cache + (long)g * D, ldr, (long)G * D, slots + b * S, lens[b], bias + i * S, NULL, 0,
                       D, sc, keys, ld, out + (i * H + (long)g * r) * D);
        }
        free(qs);
    }
    return fail;
}

/* Causal grouped-query attention of a sequence's first chunk (GQAttention's prefill groups): query t of
 * q [T, H, D] (rows ldq apart, heads D apart) attends keys 0..t, read from the paged cache rows slots[0..T-1]
 * (cache [rows, 2 * G * D] as glm5_gqa_decode) -> out [T, H, D] contiguous = softmax(q k^T * scale) v per head.
 * Flash-style: the key and value heads are first packed per key/value head (keys transposed [D, Tp], values
 * [Tp, D], zero-padded to Tp = a multiple of PREFILL_KB), then each work item (key/value head, block of
 * PREFILL_QB query rows, query head of the group) walks the key blocks up to its last query with a running
 * max and sum, both products on tiled_gemm; blocks past the diagonal are not visited. Returns 0; 2 for a slot
 * outside [0, rows); 3 for H not a multiple of G; 1 when out of memory. */
#define PREFILL_QB 8  /* query rows per work item: one register tile of tiled_gemm */
#define PREFILL_KB 32 /* keys per block: one wide tile's columns */
int glm5_gqa_prefill(const float *q, long ldq, long T, int H, int G, int D, const float *cache, long rows,
                     const int64_t *slots, float scale, float *out, int threads) {
    if (G <= 0 || H % G) return 3;
    for (long s = 0; s < T; s++)
        if (slots[s] < 0 || slots[s] >= rows) return 2;
    if (T <= 0) return 0;
    const int r = H / G;
    const long Tp = (T + PREFILL_KB - 1) / PREFILL_KB * PREFILL_KB, ldr = 2L * G * D;
    float *kt = malloc(sizeof(float) * G * D * Tp), *vp = malloc(sizeof(float) * G * Tp * D);
    if (!kt || !vp) {
        free(kt);
        free(vp);
        return 1;
    }
    for (int g = 0; g < G; g++)
        for (long s = 0; s < Tp; s++) {
            const float *row = s < T ? cache + slots[s] * ldr : NULL;
            float *kg = kt + (long)g * D * Tp + s, *vg = vp + ((long)g * Tp + s) * D;
            for (int d = 0; d < D; d++) {
                kg[(long)d * Tp] = row ? row[(long)g * D + d] : 0.0f;
                vg[d] = row ? row[(long)(G + g) * D + d] : 0.0f;
            }
        }
    const long nqb = (T + PREFILL_QB - 1) / PREFILL_QB, items = (long)G * nqb * r;
    int nt = n_threads(threads);
    if (nt > items) nt = (int)items;
    int fail = 0;
#pragma omp parallel num_threads(nt) reduction(| : fail) if (nt > 1)
    {
        const long QB = PREFILL_QB, KB = PREFILL_KB;
        float *qs = malloc(sizeof(float) * (QB * (3L * D + KB + 2)));
        float *sc = qs ? qs + QB * D : NULL, *tmp = sc ? sc + QB * KB : NULL, *acc = tmp ? tmp + QB * D : NULL;
        float *mx = acc ? acc + QB * D : NULL, *sum = mx ? mx + QB : NULL;
        fail |= !qs;
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            if (!qs) continue;
            const int g = (int)(it / (nqb * r)), h = g * r + (int)(it % r);
            const long t0 = (it / r) % nqb * QB;
            const int R = (int)(T - t0 < QB ? T - t0 : QB);
            for (int i = 0; i < R; i++) {
                const float *qi = q + (t0 + i) * ldq + (long)h * D;
                for (int d = 0; d < D; d++) qs[i * D + d] = qi[d] * scale;
                mx[i] = -INFINITY;
                sum[i] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * R * D);
            const float *kg = kt + (long)g * D * Tp, *vg = vp + (long)g * Tp * D;
            for (long k0 = 0; k0 < t0 + R; k0 += KB) {
                const int nk = (int)(t0 + R - k0 < KB ? t0 + R - k0 : KB);
                tiled_gemm(qs, D, R, D, kg + k0, Tp, (int)KB, sc); /* sc [R, KB] = q . k for keys k0 .. k0 + KB */
                for (int i = 0; i < R; i++) {
                    float *si = sc + i * KB;
                    const long lim = t0 + i - k0 + 1; /* keys of this block that query t0 + i may see */
                    const int n = (int)(lim < KB ? lim : KB);
                    float m = mx[i];
                    int j = 0;
                    if (n == KB) { /* a full block: vector max (no serial chain of comparisons) */
                        v8 vm = *(v8 *)si;
                        for (j = 8; j < KB; j += 8) {
                            v8 x = *(v8 *)(si + j);
                            vi8 gt = x > vm;
                            vm = (v8)(((vi8)x & gt) | ((vi8)vm & ~gt));
                        }
                        for (int u = 0; u < 8; u++) m = vm[u] > m ? vm[u] : m;
                    } else
                        for (; j < n; j++) m = si[j] > m ? si[j] : m;
                    const float alpha = mx[i] == -INFINITY ? 0.0f : expf(mx[i] - m);
                    v8 vs = (v8){0};
                    for (j = 0; j + 8 <= n; j += 8) {
                        v8 e = exp8(*(v8 *)(si + j) - m);
                        *(v8 *)(si + j) = e;
                        vs += e;
                    }
                    float add = 0.0f;
                    for (int u = 0; u < 8; u++) add += vs[u];
                    for (; j < n; j++) {
                        si[j] = expf(si[j] - m);
                        add += si[j];
                    }
                    for (; j < KB; j++) si[j] = 0.0f; /* masked keys (and the zero padding) weigh nothing */
                    mx[i] = m;
                    sum[i] = sum[i] * alpha + add;
                    if (alpha != 1.0f)
                        for (int d = 0; d < D; d++) acc[i * D + d] *= alpha;
                }
                tiled_gemm(sc, KB, R, nk, vg + k0 * D, D, D, tmp); /* tmp [R, D] = p . v over the block's keys */
                for (long e = 0; e < (long)R * D; e++) acc[e] += tmp[e];
            }
            for (int i = 0; i < R; i++) {
                float *o = out + ((t0 + i) * H + h) * (long)D;
                const float inv = 1.0f / sum[i];
                for (int d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
            }
        }
        free(qs);
    }
    free(kt);
    free(vp);
    return fail;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Rotary embedding                                                                                      */

/* y[t, h] = x[t, h] rotated by token t's angles (cos / sin [N, P/2]) for N tokens x H heads of P values: x
 * rows (t * H + h) ldx apart, y contiguous [N, H, P]. interleave: pairs (x[2i], x[2i+1]) (GPT-J); else
 * (x[i], x[i + P/2]) (NeoX). Output [x1 cos - x2 sin | x2 cos + x1 sin], as `apply_rope`. */
void glm5_rope(const float *x, long ldx, const float *cs, const float *sn, float *y, long N, int H, int P,
               int interleave) {
    int half = P / 2;
    for (long t = 0; t < N; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (int h = 0; h < H; h++) {
            const float *xr = x + (t * H + h) * ldx;
            float *yr = y + (t * H + h) * (long)P;
            for (int i = 0; i < half; i++) {
                float x1 = interleave ? xr[2 * i] : xr[i], x2 = interleave ? xr[2 * i + 1] : xr[i + half];
                yr[i] = x1 * c[i] - x2 * s[i];
                yr[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* In place, half-split pairs (x[i], x[i + P/2]) only: the first P values of each head row x + t * lt + h * lh
 * (N tokens x H heads) rotated by token t's angles (cs / sn [N, P/2]); values past P are left as they are
 * (partial rotary). The same arithmetic as glm5_rope with interleave = 0. */
void glm5_rope_heads(float *x, long lt, long lh, const float *cs, const float *sn, long N, int H, int P) {
    int half = P / 2;
    for (long t = 0; t < N; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (int h = 0; h < H; h++) {
            float *xr = x + t * lt + h * lh;
            for (int i = 0; i < half; i++) {
                float x1 = xr[i], x2 = xr[i + half];
                xr[i] = x1 * c[i] - x2 * s[i];
                xr[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* RMSNorm                                                                                               */

/* y[r] = x[r] * 1 / sqrt(mean(x[r]^2) + eps) * w for N rows of D, as RMSNorm's fp32 forward: x rows ldx
 * apart (a column slice, e.g. the latent part of the kv_a projection), y contiguous. */
void glm5_rms_norm(const float *x, long ldx, const float *w, float *y, long N, int D, float eps) {
    for (long r = 0; r < N; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * D;
        v8 acc = {0};
        int dv = D / 8 * 8, j = 0;
        for (; j < dv; j += 8) {
            v8 v = *(const v8 *)(xr + j);
            acc += v * v;
        }
        float ss = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
        for (; j < D; j++) ss += xr[j] * xr[j];
        float rstd = 1.0f / sqrtf(ss / (float)D + eps);
        for (j = 0; j < D; j++) yr[j] = w[j] * (xr[j] * rstd);
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* Linear layer for a few rows                                                                           */

/* y[R, N] = x[R, K] @ wt[K, N] (+ bias[N]) for the [in, out]-stored weight wt (rows ldw apart), x rows ldx
 * apart, y contiguous: small_gemm's streaming regimes for decode-sized R (BLAS's GEMV reads a small weight
 * at 6-12 GB/s here; one in-order stream at 14-17). */
void glm5_linear(const float *x, long ldx, int R, int K, const float *wt, long ldw, int N, const float *bias,
                 float *y) {
    small_gemm(x, ldx, R, K, wt, ldw, N, y);
    if (bias)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < N; j++) y[(long)r * N + j] += bias[j];
}

/* ---------------------------------------------------------------------------------------------------- */
/* One decoder layer for a decode step of a few rows                                                    */

/* The weights and options of one decoder layer (glm5.model.model.DecoderLayer). Linear weights are the
 * [in, out]-stored matrices of the engine's CPU layout (glm5/infer/layout.py) and the biases may be NULL;
 * kvb is kv_b_proj's weight [H*(E+V), R] as the model keeps it, wr the router's [NE, D]. */
typedef struct {
    int D, QR, H, E, P, V, R;       /* hidden, q_lora_rank, heads, nope / rope / value head dims, kv_lora_rank */
    int ID, IP;                     /* indexer key width (0: no indexer key is cached) and its rotated part */
    int rope_interleave, index_interleave;
    int FI;                         /* dense SwiGLU width (a dense layer), else 0 */
    int NE, A, EI, SI;              /* routed experts, per token, their width, the shared experts' width */
    int n_group, topk_group, softmax_scores, norm_topk;
    float eps_in, eps_q, eps_kv, eps_post, eps_ik, temperature, scaling, scale;
    const float *ln_in, *wqa, *bqa, *ln_q, *wqb, *wkva, *bkva, *ln_kv, *kvb, *wo, *bo;
    const float *wk, *ik_w, *ik_b, *ln_post;
    const float *wg, *wu, *wd;      /* the dense SwiGLU, or the shared expert(s) */
    const float *wr, *rbias;        /* router weight, selection-only correction bias */
    const float *gu, *dn;           /* routed experts: gate_up [NE][D, 2EI], down [NE][EI, D] */
    long gu_es, dn_es;
    int NI;                         /* indexer query heads (its queries: q_resid wqi, weights: x wwp) */
    const float *wqi, *wwp;
    /* INT8 weights (glm5.infer.quant): a non-NULL scale [out] makes its weight an int8 [out, in] row-major
     * matrix (Int8Linear) instead of fp32 [in, out]; s_gu / s_dn [NE][2EI] / [NE][D] for Int8Experts,
     * whose gu / dn are then int8 [NE][2EI, D] / [NE][D, EI] */
    const float *s_qa, *s_qb, *s_kva, *s_o, *s_g, *s_u, *s_d, *s_gu, *s_dn;
} layer_t;

/* layer_t's layout for the ctypes mirror (glm5.native.LayerSpec), checked when the library is loaded: every
 * field by name, its offset and size, and the struct's size. A field added to layer_t and not listed here
 * shows as a size mismatch; a listed name not in layer_t does not compile. */
#define LAYER_FIELDS X(D) X(QR) X(H) X(E) X(P) X(V) X(R) X(ID) X(IP) X(rope_interleave) X(index_interleave) \
    X(FI) X(NE) X(A) X(EI) X(SI) X(n_group) X(topk_group) X(softmax_scores) X(norm_topk) X(eps_in) X(eps_q) \
    X(eps_kv) X(eps_post) X(eps_ik) X(temperature) X(scaling) X(scale) X(ln_in) X(wqa) X(bqa) X(ln_q) X(wqb) \
    X(wkva) X(bkva) X(ln_kv) X(kvb) X(wo) X(bo) X(wk) X(ik_w) X(ik_b) X(ln_post) X(wg) X(wu) X(wd) X(wr) \
    X(rbias) X(gu) X(dn) X(gu_es) X(dn_es) X(NI) X(wqi) X(wwp) X(s_qa) X(s_qb) X(s_kva) X(s_o) X(s_g) X(s_u) \
    X(s_d) X(s_gu) X(s_dn)
#define X(f) #f " "
static const char layer_names[] = LAYER_FIELDS;
#undef X
#define X(f) {(long)offsetof(layer_t, f), (long)sizeof(((layer_t *)0)->f)},
static const long layer_offsets[][2] = {LAYER_FIELDS};
#undef X

/* -> the field names (space-separated); offsets / sizes [cap] filled for the first cap fields, *count the
 * number of fields, *total sizeof(layer_t). */
const char *glm5_layer_layout(long *offsets, long *sizes, long cap, long *count, long *total) {
    long n = (long)(sizeof(layer_offsets) / sizeof(layer_offsets[0]));
    for (long i = 0; i < n && i < cap; i++) {
        offsets[i] = layer_offsets[i][0];
        sizes[i] = layer_offsets[i][1];
    }
    *count = n;
    *total = (long)sizeof(layer_t);
    return layer_names;
}

/* y [R, N] = x [R, K] @ wt [K, N] (+ bias) on up to nt threads: for a few rows and a weight of at least
 * LIN_SPLIT floats, each thread streams its own contiguous band of weight rows (one core's stream reads
 * 14-17 GB/s here, two 26) into a partial sum, and the partials are added in thread order. A scale makes
 * wt an int8 [N, K] weight (lin8, one thread). */
#define LIN_SPLIT 65536
/* y [R, N] = x [R, K] @ (w * scale)^T + bias for an int8 weight w [N, K] row-major with per-output scales
 * (glm5.infer.quant.int8_linear's fp32 "dequant" arithmetic: fp32 activations, the products summed, then
 * scaled): one weight row at a time (K bytes, a quarter of the fp32 stream), dotted with each input row. */
/* 8 int8 weights as 8 floats (AVX2: one sign-extending load and one conversion; else element by element) */
static inline v8 i8x8(const int8_t *w) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
#else
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = (float)w[l];
    return r;
#endif
}

static void lin8(const float *x, long ldx, int R, int K, const int8_t *w, const float *scale, int N,
                 const float *bias, float *y) {
    int kv = K / 16 * 16;
    for (int n = 0; n < N; n++) {
        const int8_t *wr = w + (long)n * K;
        for (int r = 0; r < R; r++) {
            const float *xr = x + (long)r * ldx;
            v8 a0 = {0}, a1 = {0};
            int k = 0;
            for (; k < kv; k += 16) {
                a0 += i8x8(wr + k) * *(const v8 *)(xr + k);
                a1 += i8x8(wr + k + 8) * *(const v8 *)(xr + k + 8);
            }
            a0 += a1;
            float sum = a0[0] + a0[1] + a0[2] + a0[3] + a0[4] + a0[5] + a0[6] + a0[7];
            for (; k < K; k++) sum += (float)wr[k] * xr[k];
            y[(long)r * N + n] = bias ? sum * scale[n] + bias[n] : sum * scale[n];
        }
    }
}

static void lin(const float *x, int R, int K, const float *wt, const float *scale, int N, const float *bias, float *y,
                int nt) {
    if (scale) {
        lin8(x, K, R, K, (const int8_t *)wt, scale, N, bias, y);
        return;
    }
    float *part = nt > 1 && R <= LIN_ROWS && (long)K * N >= LIN_SPLIT && K >= 8 * nt
                      ? malloc(sizeof(float) * (nt - 1) * (long)R * N) : NULL;
    if (!part) {
        glm5_linear(x, K, R, K, wt, N, N, bias, y);
        return;
    }
    int used = 1;
#pragma omp parallel num_threads(nt)
    {
        int t = thread_id(), n = team_size();
        long k0 = (long)K * t / n, k1 = (long)K * (t + 1) / n;
        small_gemm(x + k0, K, R, (int)(k1 - k0), wt + k0 * N, N, N, t ? part + (t - 1) * (long)R * N : y);
        if (t == 0) used = n;
    }
    for (int t = 1; t < used; t++) {
        const float *p = part + (t - 1) * (long)R * N;
        for (long i = 0; i < (long)R * N; i++) y[i] += p[i];
    }
    if (bias)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < N; j++) y[(long)r * N + j] += bias[j];
    free(part);
}

/* SwiGLU down(silu(x wg) * (x wu)) for R rows (x rows ldx apart) into y [R, D]; buf holds 2 * R * F floats.
 * Weights [in, out]-stored fp32, or int8 [out, in] where their scale (s_*) is given. */
static int swiglu_w(const float *x, long ldx, int R, int D, int F, const float *wg, const float *s_g,
                    const float *wu, const float *s_u, const float *wd, const float *s_d, float *buf, float *y,
                    int nt) {
    float *g = buf, *u = buf + (long)R * F;
    const float *xc = x;
    float *xcopy = NULL;
    if (ldx != D) { /* lin reads rows K apart */
        xcopy = malloc(sizeof(float) * (long)R * D);
        if (!xcopy) return 1;
        for (int r = 0; r < R; r++) memcpy(xcopy + (long)r * D, x + r * ldx, sizeof(float) * D);
        xc = xcopy;
    }
    lin(xc, R, D, wg, s_g, F, NULL, g, nt);
    lin(xc, R, D, wu, s_u, F, NULL, u, nt);
    for (long i = 0; i < (long)R * F; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    lin(g, R, F, wd, s_d, D, NULL, y, nt);
    free(xcopy);
    return 0;
}

static void swiglu_rows(const layer_t *L, const float *x, int R, int D, int F, float *buf, float *y, int nt) {
    (void)swiglu_w(x, D, R, D, F, L->wg, L->s_g, L->wu, L->s_u, L->wd, L->s_d, buf, y, nt); /* rows D apart: no copy */
}

/* y [R, D] = down(silu(x wg) * (x wu)) (glm5.model.layers.SwiGLU: a dense MLP or the shared expert) for R
 * rows of x (ldx apart) and fp32 [in, out]-stored weights wg / wu [D, F], wd [F, D]. Returns 1 when out of
 * memory. */
int glm5_swiglu(const float *x, long ldx, int R, int D, int F, const float *wg, const float *wu, const float *wd,
                float *y, int threads) {
    float *buf = malloc(sizeof(float) * 2 * (long)R * (F ? F : 1));
    if (!buf) return 1;
    int rc = swiglu_w(x, ldx, R, D, F, wg, NULL, wu, NULL, wd, NULL, buf, y, n_threads(threads));
    free(buf);
    return rc;
}

/* y [R, N] = x [R, K] @ (w * scale)^T (+ bias) for an int8 weight w [N, K] row-major with per-output fp32
 * scales (glm5.infer.quant.Int8Linear's arithmetic), x rows ldx apart: one weight row at a time. */
void glm5_linear_int8(const float *x, long ldx, int R, int K, const int8_t *w, const float *scale, int N,
                      const float *bias, float *y) {
    lin8(x, ldx, R, K, w, scale, N, bias, y);
}

/* Router options (glm5.model.moe.Router): fp32 logits over wr [NE, D] row-major / temperature, sigmoid or
 * softmax scores, the correction bias rbias for the choice only, group-limited choice when n_group > 1,
 * weights renormalised (norm_topk) and scaled. */
typedef struct {
    int D, NE, A, n_group, topk_group, softmax_scores, norm_topk;
    float temperature, scaling;
    const float *wr, *rbias;
} router_t;

/* The router of one token: logits / scores [NE] out, the A chosen experts and their weights. */
static void route(const router_t *L, const float *x, float *logits, float *scores, int64_t *idx, float *w) {
    const int NE = L->NE, A = L->A;
    float choice[1024];
    for (int e = 0; e < NE; e++) logits[e] = dot(x, L->wr + (long)e * L->D, L->D) / L->temperature;
    if (L->softmax_scores) {
        float mx = -INFINITY, z = 0;
        for (int e = 0; e < NE; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < NE; e++) z += (scores[e] = expf(logits[e] - mx));
        for (int e = 0; e < NE; e++) scores[e] /= z;
    } else {
        for (int e = 0; e < NE; e++) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
    }
    for (int e = 0; e < NE; e++) choice[e] = scores[e] + L->rbias[e];
    if (L->n_group > 1) { /* keep the topk_group groups with the best sums of their two best choices */
        int G = L->n_group, per = NE / G;
        float gs[1024];
        int keep[1024];
        for (int g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int j = 0; j < per; j++) {
                float c = choice[g * per + j];
                if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
            }
            gs[g] = b1 + b2;
            keep[g] = 0;
        }
        for (int k = 0; k < L->topk_group; k++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        for (int e = 0; e < NE; e++)
            if (!keep[e / per]) choice[e] = -INFINITY;
    }
    float sum = 0;
    for (int k = 0; k < A; k++) {
        int best = -1;
        for (int e = 0; e < NE; e++)
            if (best < 0 || choice[e] > choice[best]) best = e;
        idx[k] = best;
        choice[best] = -INFINITY;
        w[k] = scores[best];
        sum += w[k];
    }
    for (int k = 0; k < A; k++) w[k] = (L->norm_topk ? w[k] / (sum + 1e-20f) : w[k]) * L->scaling;
}

/* The router over N tokens x [N, D] (rows ldx apart): logits / scores [N, NE], the A chosen experts idx
 * [N, A] (best first) and their weights w [N, A]. Returns 3 for more than 1024 experts, 2 for groups that
 * do not divide the experts or keep fewer experts than A. */
int glm5_route(const float *x, long ldx, long N, int D, const float *wr, const float *rbias, int NE, int A,
               float temperature, int softmax_scores, int n_group, int topk_group, int norm_topk, float scaling,
               float *logits, float *scores, int64_t *idx, float *w, int threads) {
    if (NE > 1024 || A > NE) return 3;
    if (n_group > 1 && (NE % n_group || topk_group < 1 || topk_group > n_group || (long)topk_group * (NE / n_group) < A))
        return 2;
    router_t rt = {D, NE, A, n_group, topk_group, softmax_scores, norm_topk, temperature, scaling, wr, rbias};
    int nt = n_threads(threads);
    nt = N < 16 ? 1 : nt;
#pragma omp parallel for num_threads(nt) if (nt > 1)
    for (long n = 0; n < N; n++)
        route(&rt, x + n * ldx, logits + n * NE, scores + n * NE, idx + n * A, w + n * A);
    return 0;
}

/* The k-th largest (k >= 1) of a[0:m] (m >= k), reordering a: quickselect. */
static float kth_largest(float *a, long m, long k) {
    long lo = 0, hi = m - 1, want = k - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* DSA top-k for one query row (glm5.model.indexer.dsa_topk): index scores sum_h w[h] relu(q[h] . k_s) over
 * the row's allowed keys s < n (bias > -inf; key rows ik[slots[s]], ID wide), the K best -> out [K] in key
 * order, -1 after the last when fewer keys are allowed. q [NI, ID] rotated queries, w [NI] head weights
 * (scaled by NI^-1/2 ID^-1/2); sc / tmp [n], keys [n] scratch. Ties at the K-th score keep the lower keys. */
static void index_topk(const float *q, const float *w, int NI, int ID, const float *ik, const int64_t *slots, long n,
                       const float *bias, long K, float *sc, float *tmp, int64_t *keys, int64_t *out) {
    long m = 0;
    for (long s = 0; s < n; s++) {
        if (bias[s] == -INFINITY) continue;
        const float *k = ik + slots[s] * ID;
        float acc = 0;
        for (int h = 0; h < NI; h++) {
            float d = dot(q + (long)h * ID, k, ID);
            acc += w[h] * (d > 0 ? d : 0);
        }
        keys[m] = s;
        sc[m++] = acc;
    }
    long o = 0;
    if (m <= K) {
        for (long i = 0; i < m; i++) out[o++] = keys[i];
    } else {
        memcpy(tmp, sc, sizeof(float) * m);
        float thr = kth_largest(tmp, m, K);
        long above = 0;
        for (long i = 0; i < m; i++) above += sc[i] > thr;
        long ties = K - above;
        for (long i = 0; i < m && o < K; i++)
            if (sc[i] > thr || (sc[i] == thr && ties-- > 0)) out[o++] = keys[i];
    }
    for (; o < K; o++) out[o] = -1;
}

/* x [N, D] -> out [N, D]: the whole decoder layer for N query rows (items b * T + t of B sequences x T) over
 * their sequences' cached keys, as DecoderLayer.forward with a paged context computes it when every key
 * is attended (no top-k selection): input RMSNorm; q_a -> RMSNorm -> q_b, RoPE on the rope part; kv_a ->
 * RMSNorm on the latent, RoPE on the rope key, both written to latent row slot[n] (lat [rows, R+P]); the
 * indexer key (wk -> LayerNorm -> RoPE on its first IP values) written to ik[slot[n]] when ID > 0;
 * absorbed MLA over the keys (as glm5_mla_decode); o_proj; residual; post-attention RMSNorm; the dense
 * SwiGLU or the MoE (router, routed experts as glm5_moe, shared expert); residual. cs / sn [N, P/2] are
 * the rows' RoPE angles. K > 0: attention over a DSA top-K selection of keys instead of every allowed one:
 * the rows' selections sel_in [N, K] (key indices, -1 = none: a "shared" indexer layer reusing the previous
 * layer's), or this layer's own (the indexer queries from q_resid and x, `index_topk` over the cached
 * indexer keys) written to sel_out [N, K]. attn_only: stop after the attention's residual (out = x + attention,
 * for an MLP this kernel does not run). MoE layers also return each row's router logits and scores
 * (stats [N, 2, NE]), chosen experts idx [N, A], and add one per assignment to counts [NE]. Returns as
 * glm5_latent_decode; 3 for more than 1024 experts or 64 per token. */
int glm5_decode_layer(const layer_t *L, const float *x, long N, const float *cs, const float *sn,
                      const int64_t *slot, float *lat, long rows, float *ik, long B, long T, const int64_t *slots,
                      long S, const float *bias, const int64_t *lens, const int64_t *sel_in, int64_t *sel_out,
                      long K, int attn_only, float *out, float *stats, int64_t *idx, int64_t *counts,
                      int threads) {
    const int D = L->D, H = L->H, E = L->E, P = L->P, R = L->R, V = L->V, W = R + P, QW = E + P;
    const int nt = n_threads(threads);
    if (L->NE > 1024 || L->A > 64) return 3;
    if (B * T != N || K < 0 || K > S || (K && !sel_in && (!L->NI || !L->ID || !ik || !sel_out))) return 2;
    for (long n = 0; n < N; n++)
        if (slot[n] < 0 || slot[n] >= rows) return 2;
    if (keys_ok(B, T, S, slots, lens, rows, sel_in, K)) return 2; /* before anything is written */
    long F = L->FI > L->SI ? L->FI : L->SI;
    long need = N * ((long)D * 3 + L->QR + (long)H * QW + (long)H * P + W + (L->ID > 0 ? L->ID : 0) + (long)H * V
                     + 2 * F + (L->NE ? L->A : 0));
    float *buf = malloc(sizeof(float) * (need ? need : 1));
    if (!buf) return 1;
    float *xn = buf, *h = xn + N * D, *m = h + N * D, *qa = m + N * D, *q = qa + N * L->QR;
    float *qr = q + N * H * QW, *kva = qr + N * H * P, *kk = kva + N * W, *o = kk + N * (L->ID > 0 ? L->ID : 0);
    float *fb = o + N * H * V, *rw = fb + 2 * N * F;
    int half = P / 2;
    /* attention inputs, this step's cache rows */
    glm5_rms_norm(x, D, L->ln_in, xn, N, D, L->eps_in);
    lin(xn, (int)N, D, L->wqa, L->s_qa, L->QR, L->bqa, qa, nt);
    glm5_rms_norm(qa, L->QR, L->ln_q, qa, N, L->QR, L->eps_q);
    lin(qa, (int)N, L->QR, L->wqb, L->s_qb, H * QW, NULL, q, nt);
    glm5_rope(q + E, QW, cs, sn, qr, N, H, P, L->rope_interleave);
    lin(xn, (int)N, D, L->wkva, L->s_kva, W, L->bkva, kva, nt);
    for (long n = 0; n < N; n++) {
        float *row = lat + slot[n] * W;
        glm5_rms_norm(kva + n * W, W, L->ln_kv, row, 1, R, L->eps_kv);
        glm5_rope(kva + n * W + R, P, cs + n * half, sn + n * half, row + R, 1, 1, P, L->rope_interleave);
    }
    if (L->ID > 0) {
        const int ID = L->ID;
        lin(xn, (int)N, D, L->wk, NULL, ID, NULL, kk, nt);
        for (long n = 0; n < N; n++) {
            float *k = kk + n * ID, mean = 0, var = 0;
            for (int j = 0; j < ID; j++) mean += k[j];
            mean /= (float)ID;
            for (int j = 0; j < ID; j++) var += (k[j] - mean) * (k[j] - mean);
            float rstd = 1.0f / sqrtf(var / (float)ID + L->eps_ik);
            for (int j = 0; j < ID; j++) k[j] = (k[j] - mean) * rstd * L->ik_w[j] + L->ik_b[j];
            float *row = ik + slot[n] * ID;
            glm5_rope(k, L->IP, cs + n * half, sn + n * half, row, 1, 1, L->IP, L->index_interleave);
            memcpy(row + L->IP, k + L->IP, sizeof(float) * (ID - L->IP));
        }
    }
    const int64_t *sel = sel_in;
    if (K && !sel_in) { /* this layer's own top-K: indexer queries and head weights, then each row's keys */
        const int NI = L->NI, ID = L->ID, IP = L->IP;
        float *qi = malloc(sizeof(float) * (N * (long)NI * ID + N * NI + (long)NI * IP));
        if (!qi) {
            free(buf);
            return 1;
        }
        float *wi = qi + N * NI * ID, *rot = wi + N * NI;
        lin(qa, (int)N, L->QR, L->wqi, NULL, NI * ID, NULL, qi, nt);
        lin(xn, (int)N, D, L->wwp, NULL, NI, NULL, wi, nt);
        for (long n = 0; n < N; n++) {
            float *qn = qi + n * NI * ID;
            glm5_rope(qn, ID, cs + n * half, sn + n * half, rot, 1, NI, IP, L->index_interleave);
            for (int h = 0; h < NI; h++) memcpy(qn + (long)h * ID, rot + (long)h * IP, sizeof(float) * IP);
            for (int h = 0; h < NI; h++) wi[n * NI + h] = wi[n * NI + h] * (1.0f / sqrtf((float)NI)) * (1.0f / sqrtf((float)ID));
        }
        int st = nt < N ? nt : (int)N, fail = 0;
#pragma omp parallel num_threads(st) reduction(| : fail) if (st > 1)
        { /* rows in parallel, each thread with its own score / key scratch */
            float *sc = malloc((sizeof(float) * 2 + sizeof(int64_t)) * (S ? S : 1));
            fail |= !sc;
#pragma omp for schedule(dynamic, 1)
            for (long i = 0; i < N; i++) {
                if (!sc) continue;
                long b = i / T;
                index_topk(qi + i * NI * ID, wi + i * NI, NI, ID, ik, slots + b * S, lens[b], bias + i * S, K, sc,
                           sc + S, (int64_t *)(sc + 2 * S), sel_out + i * K);
            }
            free(sc);
        }
        if (fail) {
            free(qi);
            free(buf);
            return 1;
        }
        free(qi);
        sel = sel_out;
    }
    absorb_t ab = {q, qr, L->kvb, (long)H * QW, QW, E, V, P};
    int rc = latent_items(NULL, &ab, B, T, H, W, lat, slots, S, bias, lens, R, L->scale, sel, K, o, threads);
    if (rc) {
        free(buf);
        return rc;
    }
    lin(o, (int)N, H * V, L->wo, L->s_o, D, L->bo, h, nt);
    for (long i = 0; i < N * D; i++) h[i] += x[i];
    if (attn_only) { /* the caller runs the block's second half (DecoderLayer.feed_forward) */
        memcpy(out, h, sizeof(float) * N * D);
        free(buf);
        return 0;
    }
    glm5_rms_norm(h, D, L->ln_post, xn, N, D, L->eps_post);
    if (L->NE == 0) {
        swiglu_rows(L, xn, (int)N, D, L->FI, fb, m, nt);
    } else {
        const int NE = L->NE, A = L->A;
        router_t rt = {D, NE, A, L->n_group, L->topk_group, L->softmax_scores, L->norm_topk, L->temperature,
                       L->scaling, L->wr, L->rbias};
        for (long n = 0; n < N; n++) {
            route(&rt, xn + n * D, stats + n * 2 * NE, stats + n * 2 * NE + NE, idx + n * A, rw + n * A);
            for (int k = 0; k < A; k++) counts[idx[n * A + k]]++;
        }
        if (L->s_gu) { /* INT8 experts: each row's experts in id order, as the expert loop adds them */
            const int EI = L->EI;
            float *eb = malloc(sizeof(float) * (3L * EI + D));
            if (!eb) {
                free(buf);
                return 1;
            }
            for (long n = 0; n < N; n++) {
                int64_t ord[64];
                float ow[64];
                for (int j = 0; j < A; j++) { /* insertion sort of the row's experts by id */
                    int64_t e = idx[n * A + j];
                    float wj = rw[n * A + j];
                    int i = j;
                    while (i > 0 && ord[i - 1] > e) { ord[i] = ord[i - 1]; ow[i] = ow[i - 1]; i--; }
                    ord[i] = e;
                    ow[i] = wj;
                }
                float *mo = m + n * D;
                memset(mo, 0, sizeof(float) * D);
                for (int j = 0; j < A; j++) {
                    const int64_t e = ord[j];
                    float *g = eb, *u = eb + EI, *y = eb + 2L * EI;
                    lin8(xn + n * D, D, 1, D, (const int8_t *)L->gu + e * 2L * EI * D, L->s_gu + e * 2L * EI, 2 * EI, NULL, g);
                    for (int i = 0; i < EI; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
                    lin8(g, EI, 1, EI, (const int8_t *)L->dn + e * (long)D * EI, L->s_dn + e * (long)D, D, NULL, y);
                    for (int i = 0; i < D; i++) mo[i] += y[i] * ow[j];
                }
            }
            free(eb);
        } else {
            rc = glm5_moe(xn, N, D, idx, rw, A, NE, L->EI, L->gu, L->gu_es, L->dn, L->dn_es, m, threads);
            if (rc) {
                free(buf);
                return rc == 1 ? 1 : 3;
            }
        }
        if (L->SI > 0) { /* the shared expert(s), added to the routed sum as MoE.forward does */
            swiglu_rows(L, xn, (int)N, D, L->SI, fb, out, nt);
            for (long i = 0; i < N * D; i++) m[i] += out[i];
        }
    }
    for (long i = 0; i < N * D; i++) out[i] = h[i] + m[i];
    free(buf);
    return 0;
}
