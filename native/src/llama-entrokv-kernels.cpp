// EntroKV Edge: the recall tier's arithmetic kernels (entrokv_edge/runtime/recall.py calls them for
// every slot at every recall; tests check them against numpy): the digests' ranking, and a softmax of
// rows in place (the attention a recall computes for queries the decode did not hand over).
//
// The ranking, per slot: the stored pages' digests (the mean of each page's keys) against the recall's queries.
// A page's mass is, for the query head that gives it most, the sum over the recall's tokens of
// min(1, count x exp(q . mean - lse)): the attention its tokens would get if each had the mean key,
// at most 1 per query. The N pages of largest mass are the ones the recall reads and scores exactly.
//
// This is the recall's largest arithmetic (queries x pages x head_dim per slot). The products are
// blocked (4 queries x 16 pages in registers, the means read once per block) and the exponential is a
// polynomial; where the CPU has AVX2 and FMA (checked at run time) both run 8 lanes at a time, whatever
// flags the rest of the build has, else in plain C++ (also with ENTROKV_NO_SIMD=1 in the environment).
// Also here: F16 to float (F16C where the CPU has it) and the store's digest update.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

namespace {

constexpr int QB = 4;       // queries per block
constexpr int32_t MAX_COUNT = 1 << 24;      // tokens of a stored page at most (the logs of 0..MAX_COUNT are tabled)
constexpr int PB = 16;      // pages per block

#if defined(__GNUC__)
#define ENTROKV_INLINE __attribute__((always_inline)) inline
#else
#define ENTROKV_INLINE inline
#endif

// exp(x) for x <= 0 (-inf included), as a float: Cephes' polynomial after x = k ln 2 + f. Below -87
// (and for a NaN) the result is exp(-87), a mass of 1e-38 that ranks below any that counts; a query
// block's padding (lse +inf) adds that much to every page alike. Branch-free: vectorisable.
ENTROKV_INLINE float exp_nonpos(float x) {
    x = x >= -87.0f ? x : -87.0f;
    const float y = x * 1.44269504088896341f;
    const int32_t k = (int32_t) (y - 0.5f);                  // y <= 0: y rounded to the nearest integer
    const float kf = (float) k;
    const float f = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    const int32_t bits = (k + 127) << 23;                    // 2^k, k >= -126
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

// The means of pages p0 .. p0 + PB - 1 as a dense [d][PB] block: in place when they are whole (rows ld
// apart), else copied into tail with zeros past the last page.
const float * page_block(const float * means, int64_t ld, int32_t d, int32_t p0, int32_t np, float * tail, int64_t & mld) {
    if (np == PB) {
        mld = ld;
        return means + p0;
    }
    for (int32_t k = 0; k < d; ++k) {
        for (int32_t p = 0; p < PB; ++p) {
            tail[(size_t) k * PB + p] = p < np ? means[(size_t) k * ld + p0 + p] : 0.0f;
        }
    }
    mld = PB;
    return tail;
}

// One slot's masses, page block by page block (each block's means read once for every query). qs
// [r][n_blk * QB][d]: the queries of each head, padded to whole blocks of QB with zeros whose lse
// (ls [r][n_blk * QB]) is +inf; means [d] rows of ld floats; logc [n_pages] the log of each page's
// count (-inf: no token). mass[p] = max over heads of the sum over queries of exp(min(0, q . mean - lse
// + logc)) = min(1, count exp(q . mean - lse)).
void slot_mass(const float * qs, const float * ls, int32_t r, int32_t n_blk, int32_t d, const float * means, int64_t ld,
        const float * logc, int32_t n_pages, float * mass, float * tail) {
    const int32_t nb = n_blk * QB;
    for (int32_t p0 = 0; p0 < n_pages; p0 += PB) {
        const int32_t np = std::min<int32_t>(PB, n_pages - p0);
        int64_t mld = 0;
        const float * m = page_block(means, ld, d, p0, np, tail, mld);
        float best[PB] = {};
        for (int32_t h = 0; h < r; ++h) {
            float sum[PB] = {};
            for (int32_t b = 0; b < n_blk; ++b) {
                const float * q = qs + ((size_t) h * nb + (size_t) b * QB) * d;
                const float * l = ls + (size_t) h * nb + (size_t) b * QB;
                float acc[QB][PB] = {};
                for (int32_t k = 0; k < d; ++k) {
                    const float * row = m + (size_t) k * mld;
                    for (int j = 0; j < QB; ++j) {
                        const float qv = q[(size_t) j * d + k];
                        for (int p = 0; p < PB; ++p) {
                            acc[j][p] += qv * row[p];
                        }
                    }
                }
                for (int j = 0; j < QB; ++j) {
                    for (int p = 0; p < PB; ++p) {
                        const float lc = p < np ? logc[p0 + p] : -std::numeric_limits<float>::infinity();
                        const float t = acc[j][p] - l[j] + lc;
                        sum[p] += exp_nonpos(t < 0.0f ? t : 0.0f);
                    }
                }
            }
            for (int p = 0; p < PB; ++p) {
                best[p] = std::max(best[p], sum[p]);
            }
        }
        for (int p = 0; p < np; ++p) {
            mass[p0 + p] = best[p];
        }
    }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(ENTROKV_NO_AVX2)
#define ENTROKV_AVX2 1

// slot_mass with AVX2 and FMA: 4 queries x 16 pages of products in eight registers, the exponential
// 8 lanes at a time (the same polynomial, its steps fused)
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpos8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256i k = _mm256_cvttps_epi32(_mm256_fmsub_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    const __m256 kf = _mm256_cvtepi32_ps(k);
    const __m256 f = _mm256_fnmadd_ps(kf, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, f), f, _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) void slot_mass_avx2(const float * qs, const float * ls, int32_t r, int32_t n_blk,
        int32_t d, const float * means, int64_t ld, const float * logc, int32_t n_pages, float * mass, float * tail) {
    static_assert(QB == 4 && PB == 16, "the registers below hold 4 queries x 16 pages");
    const int32_t nb = n_blk * QB;
    const __m256 zero = _mm256_setzero_ps();
    for (int32_t p0 = 0; p0 < n_pages; p0 += PB) {
        const int32_t np = std::min<int32_t>(PB, n_pages - p0);
        int64_t mld = 0;
        const float * m = page_block(means, ld, d, p0, np, tail, mld);
        alignas(32) float lc[PB];
        for (int p = 0; p < PB; ++p) {
            lc[p] = p < np ? logc[p0 + p] : -std::numeric_limits<float>::infinity();
        }
        const __m256 lc0 = _mm256_load_ps(lc), lc1 = _mm256_load_ps(lc + 8);
        __m256 best0 = zero, best1 = zero;
        for (int32_t h = 0; h < r; ++h) {
            __m256 s0 = zero, s1 = zero;
            for (int32_t b = 0; b < n_blk; ++b) {
                const float * q0 = qs + ((size_t) h * nb + (size_t) b * QB) * d;
                const float * q1 = q0 + d;
                const float * q2 = q1 + d;
                const float * q3 = q2 + d;
                const float * l = ls + (size_t) h * nb + (size_t) b * QB;
                __m256 a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero, a30 = zero, a31 = zero;
                for (int32_t k = 0; k < d; ++k) {
                    const float * row = m + (size_t) k * mld;
                    const __m256 m0 = _mm256_loadu_ps(row);
                    const __m256 m1 = _mm256_loadu_ps(row + 8);
                    __m256 v = _mm256_broadcast_ss(q0 + k);
                    a00 = _mm256_fmadd_ps(v, m0, a00);
                    a01 = _mm256_fmadd_ps(v, m1, a01);
                    v = _mm256_broadcast_ss(q1 + k);
                    a10 = _mm256_fmadd_ps(v, m0, a10);
                    a11 = _mm256_fmadd_ps(v, m1, a11);
                    v = _mm256_broadcast_ss(q2 + k);
                    a20 = _mm256_fmadd_ps(v, m0, a20);
                    a21 = _mm256_fmadd_ps(v, m1, a21);
                    v = _mm256_broadcast_ss(q3 + k);
                    a30 = _mm256_fmadd_ps(v, m0, a30);
                    a31 = _mm256_fmadd_ps(v, m1, a31);
                }
                const __m256 a[QB][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
                for (int j = 0; j < QB; ++j) {
                    const __m256 lj = _mm256_set1_ps(l[j]);
                    s0 = _mm256_add_ps(s0, exp_nonpos8(_mm256_min_ps(_mm256_add_ps(_mm256_sub_ps(a[j][0], lj), lc0), zero)));
                    s1 = _mm256_add_ps(s1, exp_nonpos8(_mm256_min_ps(_mm256_add_ps(_mm256_sub_ps(a[j][1], lj), lc1), zero)));
                }
            }
            best0 = _mm256_max_ps(best0, s0);
            best1 = _mm256_max_ps(best1, s1);
        }
        alignas(32) float out[PB];
        _mm256_store_ps(out, best0);
        _mm256_store_ps(out + 8, best1);
        for (int p = 0; p < np; ++p) {
            mass[p0 + p] = out[p];
        }
    }
}

} // namespace

// ENTROKV_NO_SIMD set (to anything but "" or "0") in the environment: the plain C++ paths, whatever the
// CPU has (read once, at the first call; the tests run them this way)
bool entrokv_simd_allowed() {
    static const bool ok = [] {
        const char * e = std::getenv("ENTROKV_NO_SIMD");
        return e == nullptr || e[0] == '\0' || (e[0] == '0' && e[1] == '\0');
    }();
    return ok;
}

namespace {

bool have_avx2() {
    static const bool ok = entrokv_simd_allowed() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return ok;
}
#endif

void slot_mass_any(const float * qs, const float * ls, int32_t r, int32_t n_blk, int32_t d, const float * means, int64_t ld,
        const float * logc, int32_t n_pages, float * mass, float * tail) {
#ifdef ENTROKV_AVX2
    if (have_avx2()) {
        slot_mass_avx2(qs, ls, r, n_blk, d, means, ld, logc, n_pages, mass, tail);
        return;
    }
#endif
    slot_mass(qs, ls, r, n_blk, d, means, ld, logc, n_pages, mass, tail);
}

// One row of n floats in place: x = exp(x - max) (exactly 0 where x is -inf); returns the sum, and the
// max in *mx; a NaN makes the sum NaN.
double softmax_row(float * x, int32_t n, float * mx) {
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int32_t c = 0; c < n; ++c) {
        nan |= std::isnan(x[c]);
        m = x[c] > m ? x[c] : m;
    }
    *mx = m;
    if (nan || !std::isfinite(m)) {
        return std::numeric_limits<double>::quiet_NaN();
    }
    float sum = 0.0f;
    for (int32_t c = 0; c < n; ++c) {
        const float t = x[c] - m;
        x[c] = t < -87.0f ? 0.0f : exp_nonpos(t);
        sum += x[c];
    }
    return sum;
}

#ifdef ENTROKV_AVX2
__attribute__((target("avx2,fma"))) double softmax_row_avx2(float * x, int32_t n, float * mx) {
    const int32_t n8 = n & ~7;
    __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 un = _mm256_setzero_ps();
    for (int32_t c = 0; c < n8; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    alignas(32) float t8[8];
    _mm256_store_ps(t8, vm);
    float m = t8[0];
    for (int j = 1; j < 8; ++j) {
        m = t8[j] > m ? t8[j] : m;
    }
    bool nan = _mm256_movemask_ps(un) != 0;
    for (int32_t c = n8; c < n; ++c) {
        nan |= std::isnan(x[c]);
        m = x[c] > m ? x[c] : m;
    }
    *mx = m;
    if (nan || !std::isfinite(m)) {
        return std::numeric_limits<double>::quiet_NaN();
    }
    const __m256 bm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f), zero = _mm256_setzero_ps();
    __m256 vs = zero;
    for (int32_t c = 0; c < n8; c += 8) {
        const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + c), bm);
        const __m256 e = _mm256_and_ps(exp_nonpos8(t), _mm256_cmp_ps(t, lo, _CMP_GE_OQ));     // below -87: 0
        _mm256_storeu_ps(x + c, e);
        vs = _mm256_add_ps(vs, e);
    }
    _mm256_store_ps(t8, vs);
    float sum = 0.0f;
    for (int j = 0; j < 8; ++j) {
        sum += t8[j];
    }
    for (int32_t c = n8; c < n; ++c) {
        const float t = x[c] - m;
        x[c] = t < -87.0f ? 0.0f : exp_nonpos(t);
        sum += x[c];
    }
    return sum;
}
#endif

// F16 (IEEE half) to float, exactly: every finite value, the infinities, and NaN as a NaN of the same sign
// and payload (quiet).
float f16_to_f32_one(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    if (e == 0x1Fu) {
        bits = sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else {                                    // a subnormal half: a normal float
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            --e;
        }
        bits = sign | (e << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

void f16_to_f32_plain(const uint16_t * src, float * dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = f16_to_f32_one(src[i]);
    }
}

#ifdef ENTROKV_AVX2
// the same with the F16C instruction (exact, as above; a signalling NaN comes out quiet, as above)
__attribute__((target("f16c,avx"))) void f16_to_f32_f16c(const uint16_t * src, float * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (src + i))));
    }
    f16_to_f32_plain(src + i, dst + i, n - i);
}

bool have_f16c() {
    static const bool ok = entrokv_simd_allowed() && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    return ok;
}
#endif

} // namespace

static int32_t recall_rank(int32_t n_s, int32_t n_tok, int32_t r, int32_t d, const float * q, const float * lse,
        const float * means, int64_t means_ld, const int32_t * counts, int32_t n_pages, int32_t n_out, int32_t * out) {
    if (q == nullptr || lse == nullptr || out == nullptr || (n_pages > 0 && (means == nullptr || counts == nullptr))) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_rank: a NULL array");
    }
    if (n_s < 0 || n_tok < 1 || r < 1 || d < 1 || n_pages < 0 || means_ld < n_pages || n_out < 1) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "recall_rank: bad shape (%d slots, %d tokens x %d heads, head_dim %d, %d pages a row of %lld, %d out)",
                n_s, n_tok, r, d, n_pages, (long long) means_ld, n_out);
    }
    const int32_t nq = n_tok * r;
    for (size_t i = 0; i < (size_t) n_s * nq; ++i) {
        if (!std::isfinite(lse[i])) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_rank: lse[%zu] = %g is not finite", i, (double) lse[i]);
        }
    }
    for (size_t i = 0; i < (size_t) n_s * nq * d; ++i) {
        if (!std::isfinite(q[i])) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_rank: q[%zu] = %g is not finite", i, (double) q[i]);
        }
    }
    int32_t c_max = 0;
    for (size_t i = 0; i < (size_t) n_s * n_pages; ++i) {
        if (counts[i] < 0 || counts[i] > MAX_COUNT) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_rank: counts[%zu] = %d is outside 0..%d", i,
                    counts[i], MAX_COUNT);
        }
        c_max = std::max(c_max, counts[i]);
    }
    const float ninf = -std::numeric_limits<float>::infinity();
    std::vector<float> log_of((size_t) c_max + 1);           // log of each count (0: -inf, no token)
    for (int32_t c = 0; c <= c_max; ++c) {
        log_of[c] = c > 0 ? std::log((float) c) : ninf;
    }
    const int32_t n_blk = (n_tok + QB - 1) / QB, nb = n_blk * QB;
    std::vector<float> logc(n_pages), mass(n_pages), qs((size_t) r * nb * d), ls((size_t) r * nb), tail((size_t) PB * d);
    std::vector<int32_t> idx(n_pages);
    for (int32_t s = 0; s < n_s; ++s) {
        const float * ms = means + (size_t) s * d * means_ld;
        const int32_t * cs = counts + (size_t) s * n_pages;
        for (int32_t p = 0; p < n_pages; ++p) {
            logc[p] = log_of[cs[p]];
        }
        // the queries head by head, padded to whole blocks: none past the last token (lse +inf)
        std::fill(qs.begin(), qs.end(), 0.0f);
        std::fill(ls.begin(), ls.end(), std::numeric_limits<float>::infinity());
        for (int32_t h = 0; h < r; ++h) {
            for (int32_t i = 0; i < n_tok; ++i) {
                const size_t qi = (size_t) s * nq + (size_t) i * r + h;
                std::memcpy(qs.data() + ((size_t) h * nb + i) * d, q + qi * d, sizeof(float) * d);
                ls[(size_t) h * nb + i] = lse[qi];
            }
        }
        slot_mass_any(qs.data(), ls.data(), r, n_blk, d, ms, means_ld, logc.data(), n_pages, mass.data(), tail.data());
        // the n_out pages of largest mass among those with a token (ties: lower page first)
        int32_t n_live = 0;
        for (int32_t p = 0; p < n_pages; ++p) {
            if (cs[p] > 0) {
                idx[n_live++] = p;
            }
        }
        const int32_t k = std::min(n_out, n_live);
        std::partial_sort(idx.begin(), idx.begin() + k, idx.begin() + n_live, [&](int32_t a, int32_t b) {
            return mass[a] > mass[b] || (mass[a] == mass[b] && a < b);
        });
        for (int32_t j = 0; j < n_out; ++j) {
            out[(size_t) s * n_out + j] = j < k ? idx[j] : -1;
        }
    }
    return llama_entrokv_ok();
}

extern "C" int32_t llama_entrokv_recall_rank(int32_t n_s, int32_t n_tok, int32_t r, int32_t d, const float * q,
        const float * lse, const float * means, int64_t means_ld, const int32_t * counts, int32_t n_pages, int32_t n_out,
        int32_t * out) {
    try {
        return recall_rank(n_s, n_tok, r, d, q, lse, means, means_ld, counts, n_pages, n_out, out);
    } catch (const std::exception & e) {        // an allocation that failed
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_rank failed: %s", e.what());
    }
}

static int32_t softmax_rows(float * x, int64_t n_a, int64_t stride_a, int64_t n_b, int64_t ld, int32_t n, float * lse,
        float * inv_total) {
    if (x == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "softmax_rows: x is NULL");
    }
    if (n_a < 0 || n_b < 0 || n < 1 || ld < n || stride_a < 0 || (n_a > 1 && stride_a < (n_b - 1) * ld + n)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "softmax_rows: bad shape (%lld x %lld rows of %d, %lld and %lld apart)", (long long) n_a, (long long) n_b,
                n, (long long) stride_a, (long long) ld);
    }
    for (int64_t a = 0; a < n_a; ++a) {
        for (int64_t b = 0; b < n_b; ++b) {
            float * row = x + a * stride_a + b * ld;
            float m = 0.0f;
#ifdef ENTROKV_AVX2
            const double sum = have_avx2() ? softmax_row_avx2(row, n, &m) : softmax_row(row, n, &m);
#else
            const double sum = softmax_row(row, n, &m);
#endif
            if (!(sum > 0.0) || !std::isfinite(sum)) {      // a NaN, or nothing finite in the row
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                        "softmax_rows: row (%lld, %lld) has a NaN or no finite value", (long long) a, (long long) b);
            }
            const size_t i = (size_t) (a * n_b + b);
            if (lse != nullptr) {
                lse[i] = m + (float) std::log(sum);
            }
            if (inv_total != nullptr) {
                inv_total[i] = (float) (1.0 / sum);
            }
        }
    }
    return llama_entrokv_ok();
}

extern "C" int32_t llama_entrokv_softmax_rows(float * x, int64_t n_a, int64_t stride_a, int64_t n_b, int64_t ld, int32_t n,
        float * lse, float * inv_total) {
    return softmax_rows(x, n_a, stride_a, n_b, ld, n, lse, inv_total);
}

void entrokv_f16_to_f32(const uint16_t * src, float * dst, int64_t n) {
#ifdef ENTROKV_AVX2
    if (have_f16c()) {
        f16_to_f32_f16c(src, dst, n);
        return;
    }
#endif
    f16_to_f32_plain(src, dst, n);
}

// The store's digests after tokens come in (sign +1) or leave (-1): per (slot, page) touched, its count
// changes by the tokens', and its key sum by the sum of their keys, taken in the order given (a float
// sum, the first key first) and then added to (or subtracted from) the page's; a page left with no token
// gets a sum of exactly 0. The page's mean (transposed: means_t[s][k][p]) is then sum / count, divided in
// double and rounded to a float. Checked before anything is written.
static int32_t digest_update(int32_t n, const int32_t * slot, const int32_t * page, const float * keys, int32_t d,
        int32_t sign, int32_t n_s, int32_t n_pages, float * sums, int64_t * counts, float * means_t) {
    if (n < 0 || d < 1 || n_s < 0 || n_pages < 0 || (sign != 1 && sign != -1)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "digest_update: bad shape or sign (%d tokens, head_dim %d, %d slots x %d pages, sign %d)", n, d, n_s, n_pages, sign);
    }
    if (n == 0) {
        return llama_entrokv_ok();
    }
    if (slot == nullptr || page == nullptr || keys == nullptr || sums == nullptr || counts == nullptr || means_t == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "digest_update: a NULL array");
    }
    std::vector<int64_t> at((size_t) n);
    for (int32_t i = 0; i < n; ++i) {
        if (slot[i] < 0 || slot[i] >= n_s || page[i] < 0 || page[i] >= n_pages) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "digest_update: token %d at slot %d, page %d: outside %d x %d",
                    i, slot[i], page[i], n_s, n_pages);
        }
        at[i] = (int64_t) slot[i] * n_pages + page[i];
    }
    // the tokens grouped by (slot, page), each group in the order given
    std::vector<int32_t> order((size_t) n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return at[a] < at[b]; });
    for (int32_t j = 0; j < n; ) {
        int32_t e = j + 1;
        while (e < n && at[order[e]] == at[order[j]]) {
            ++e;
        }
        const int64_t after = counts[at[order[j]]] + (int64_t) sign * (e - j);
        if (after < 0) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "digest_update: slot %d page %d would hold %lld tokens",
                    slot[order[j]], page[order[j]], (long long) after);
        }
        j = e;
    }
    std::vector<float> acc((size_t) d);
    for (int32_t j = 0; j < n; ) {
        int32_t e = j + 1;
        while (e < n && at[order[e]] == at[order[j]]) {
            ++e;
        }
        const int64_t u = at[order[j]];
        counts[u] += (int64_t) sign * (e - j);
        float * su = sums + (size_t) u * d;
        if (counts[u] == 0) {
            std::fill(su, su + d, 0.0f);
        } else {
            std::memcpy(acc.data(), keys + (size_t) order[j] * d, sizeof(float) * d);
            for (int32_t t = j + 1; t < e; ++t) {
                const float * k = keys + (size_t) order[t] * d;
                for (int32_t c = 0; c < d; ++c) {
                    acc[c] += k[c];
                }
            }
            for (int32_t c = 0; c < d; ++c) {
                su[c] += sign > 0 ? acc[c] : -acc[c];
            }
        }
        const double cnt = (double) std::max<int64_t>(counts[u], 1);
        const int64_t s = u / n_pages, p = u % n_pages;
        float * mt = means_t + (size_t) s * d * n_pages + p;
        for (int32_t c = 0; c < d; ++c) {
            mt[(size_t) c * n_pages] = (float) ((double) su[c] / cnt);
        }
        j = e;
    }
    return llama_entrokv_ok();
}

extern "C" int32_t llama_entrokv_digest_update(int32_t n, const int32_t * slot, const int32_t * page, const float * keys,
        int32_t d, int32_t sign, int32_t n_s, int32_t n_pages, float * sums, int64_t * counts, float * means_t) {
    try {
        return digest_update(n, slot, page, keys, d, sign, n_s, n_pages, sums, counts, means_t);
    } catch (const std::exception & e) {        // an allocation that failed
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "digest_update failed: %s", e.what());
    }
}
