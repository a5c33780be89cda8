// Weight-only 4-bit and 8-bit matrix products with 8-bit activations, on AVX512-VNNI.
//
// y[r, n] = sum_k x[r, k] w[n, k] for a few rows r (a decoding step, a verification block). The weights are
// read once per call whatever the number of rows: each 16-output x 32-input tile is unpacked into registers
// once and multiplied into every row of the call (vpdpbusd: 64 u8 x s8 products an instruction), so a few rows
// cost about one weight read, until the dot products bound the call (from about 4 to 8 rows, by host). Integer
// sums are exact, and every row goes through the same instructions in the same order whatever the call's size
// and the thread count (threads split the outputs, never the sum over k): a row's result depends on the row
// alone, by construction, on every CPU that runs this file.
//
// Activations: each row is quantized in blocks of inputs to int8, xq = rint(x * 127 / amax), with one float
// scale sx = amax / 127 per block: 256 for the Q4_K weights (llama.cpp's Q8_K), 32 for the int8 ones. Weights:
//   Q4_K (the GGUF grid, unchanged):  w = d * sc[g] * q - dmin * m[g], q in 0..15, per super-block of 256
//     inputs (d, dmin float) and group g of 32 (sc, m 6-bit integers), so for one row and one super-block
//       sum_k x w = sx * (d * sum_g sc[g] * (sum_{k in g} xq q) - dmin * sum_g m[g] * (sum_{k in g} xq))
//     with both inner sums integers.
//   int8, one scale per output:       w = s * q, q in -127..127:  sum_k x w = s * sum_blocks sx * sum xq q,
//     computed as u8 x s8 with q + 128 and the correction 128 * sum xq.
// Built by modeling_pacer/cpu/kernels/__init__.py with -march=native -ffp-contract=off (no fused or reordered
// float operations beyond the explicit ones below).
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PACER_VNNI 1
#include <immintrin.h>
#endif

extern "C" int pacer_kernel_abi() { return 16; }

#ifdef PACER_VNNI
extern "C" int pacer_vnni_available() { return 1; }

// x: (m, k) bf16 -> xq: (m, k) int8, quantized per block of `block` (32 or 256) inputs; sx: (m, k / block) float;
// xs: (m, k / 32) int16 (the sum of each group of 32 codes, |xs| <= 32 * 127).
extern "C" void pacer_quantize_rows(const uint16_t* x, int64_t m, int64_t k, int64_t block, int8_t* xq, float* sx,
                                    int16_t* xs) {
    const int64_t blocks = k / block;
#pragma omp parallel for schedule(static) if (m >= 8)  // a prompt's rows over threads; each row alone either way
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t* src = x + r * k + b * block;
            float v[256];
            __m512 amax = _mm512_setzero_ps();
            for (int64_t i = 0; i < block; i += 16) {
                __m256i h = _mm256_loadu_si256((const __m256i*)(src + i));
                __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                _mm512_storeu_ps(v + i, f);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(f));
            }
            const float a = _mm512_reduce_max_ps(amax);
            const float id = a > 0.0f ? 127.0f / a : 0.0f;
            sx[r * blocks + b] = a / 127.0f;
            const __m512 vid = _mm512_set1_ps(id);
            for (int64_t g = 0; g < block / 32; ++g) {
                __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + g * 32), vid));
                __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + g * 32 + 16), vid));
                q0 = _mm512_max_epi32(_mm512_min_epi32(q0, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                q1 = _mm512_max_epi32(_mm512_min_epi32(q1, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                xs[r * (k / 32) + b * (block / 32) + g] = (int16_t)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
                int8_t* dst = xq + r * k + b * block + g * 32;
                _mm_storeu_si128((__m128i*)dst, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128((__m128i*)(dst + 16), _mm512_cvtepi32_epi8(q1));
            }
        }
    }
}

#ifndef PACER_PREFETCH
#define PACER_PREFETCH 4096
#endif
static const int64_t PREFETCH = PACER_PREFETCH;  // bytes ahead of the group being computed

static inline int32_t load4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// Q4_K. For output tile t (16 outputs) and super-block b: packed[t][b][g][4][64] (zmm p: low nibbles = step p,
// high = step p + 4; step j holds inputs 4j..4j+3 of group g for the 16 outputs, 4 bytes per output),
// sc[t][b][g][16] (uint8), mn[t][b][4][16][2] (uint8: the minima of groups 2p, 2p + 1 side by side, widened to
// int16 pairs for vpdpwssd), dd[t][b][2][16] (float16: d, then dmin).
// out (rows x 16, stride ldo, float) accumulates over the super-blocks; it starts at zero.
template <int R>
static void q4_tile(const uint8_t* packed, const uint8_t* sc, const uint8_t* mn, const uint16_t* dd,
                    const int8_t* xq, const float* sx, const int16_t* xs, int64_t k, int64_t blocks, float* out,
                    int64_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i iacc[R];
        for (int r = 0; r < R; ++r) iacc[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g) {
            const uint8_t* p = packed + ((b * 8 + g) * 256);
            // the weights stream from memory: ask for those PREFETCH bytes ahead while this group computes
            _mm_prefetch((const char*)(p + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + PREFETCH + 64), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + PREFETCH + 128), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + PREFETCH + 192), _MM_HINT_T0);
            __m512i w[8];
            for (int j = 0; j < 4; ++j) {
                __m512i v = _mm512_loadu_si512((const void*)(p + j * 64));
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + (b * 8 + g) * 16)));
            for (int r = 0; r < R; ++r) {
                const int8_t* xr = xq + r * k + b * 256 + g * 32;
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(load4(xr)));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(load4(xr + 4)));
                for (int j = 2; j < 8; j += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load4(xr + 4 * j)));
                    s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(load4(xr + 4 * j + 4)));
                }
                iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scv));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32)));
        const __m512 dminv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32 + 16)));
        for (int r = 0; r < R; ++r) {
            const int16_t* xsr = xs + r * (k / 32) + b * 8;
            __m512i msum = _mm512_setzero_si512();
            for (int q = 0; q < 4; ++q) {
                const __m512i mnq = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(mn + (b * 4 + q) * 32)));
                msum = _mm512_dpwssd_epi32(msum, mnq, _mm512_set1_epi32(load4((const int8_t*)(xsr + 2 * q))));
            }
            // out += sx * (d * isum - dmin * msum), in this order for every row
            __m512 t = _mm512_sub_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(iacc[r])),
                                     _mm512_mul_ps(dminv, _mm512_cvtepi32_ps(msum)));
            float* o = out + r * ldo;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(_mm512_set1_ps(sx[r * blocks + b]), t)));
        }
    }
}

// int8. For tile t: packed[t][k / 32][8][64] (step j of group g: inputs 4j..4j+3 for the 16 outputs), the codes
// + 128 as uint8; scale[t][16]. Activations in blocks of 32: (q + 128) . xq - 128 * sum xq = q . xq.
template <int R>
static void q8_tile(const uint8_t* packed, const float* scale, const int8_t* xq, const float* sx, const int16_t* xs,
                    int64_t k, float* out, int64_t ldo) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / 32; ++g) {
        __m512i s[R];
        for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
        const uint8_t* p = packed + g * 512;
        for (int j = 0; j < 8; ++j) {
            _mm_prefetch((const char*)(p + j * 64 + PREFETCH), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512((const void*)(p + j * 64));
            for (int r = 0; r < R; ++r)
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(load4(xq + r * k + g * 32 + 4 * j)));
        }
        for (int r = 0; r < R; ++r) {
            const __m512i exact = _mm512_sub_epi32(s[r], _mm512_set1_epi32(128 * int32_t(xs[r * (k / 32) + g])));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(sx[r * (k / 32) + g]), _mm512_cvtepi32_ps(exact)));
        }
    }
    const __m512 sv = _mm512_loadu_ps(scale);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(acc[r], sv));
}

// AMX (Sapphire Rapids and later): the same integer sums from tiles, for calls of several rows. A tile dot product
// (tdpbsud: signed 8-bit activations x unsigned 8-bit weights, 32-bit sums) takes 16 rows x 32 inputs of the
// activations (tile A: xq as it lies, one row per tile row) against 32 inputs x 16 outputs of the weights (tile B:
// 8 rows of 64 bytes, each row one step j of 4 inputs for the 16 outputs: exactly the layout the VNNI loops
// unpack into their zmm registers) and gives the 16 x 16 sums of one group of 32 inputs. Integer sums are exact,
// so each group's sums are bitwise those of the VNNI loops, and the float work after them (per row, per group or
// super-block) is the VNNI loops' own code in the same order: a row's result is bitwise the same on either path,
// so a call picks its path by its number of rows without changing a bit of any row. Rows of a call are done 16 at
// a time (the A tile's rows; a call of fewer rows configures tiles of its size; past 16, the rows past the call's
// end read zeros from a padded copy and are dropped).
// Linux gives a process the AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM): where that request fails
// (an old kernel, a sandbox), or the compiler or CPU has no AMX, every call stays on VNNI.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PACER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// calls of at least this many rows go to the tiles; 0: none (set by pacer_set_amx_rows)
static int64_t amx_rows = 9;

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: the sums of four groups (rows x 16 int32 each), 4-5: activations (rows x 32 bytes), 6-7: weights (8 rows
// x 64 bytes), for calls of `rows` <= 16 rows. Four groups are in flight at once: a tile's product, store and reload
// take several times the latency of its issue, and tiles are not renamed, so one tile reused group after group
// would serialize them.
static void tile_config(int64_t rows) {
    TileConfig c;
    for (int t = 0; t < 4; ++t) { c.colsb[t] = 64; c.rows[t] = uint8_t(rows); }
    for (int t = 4; t < 6; ++t) { c.colsb[t] = 32; c.rows[t] = uint8_t(rows); }
    for (int t = 6; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 8; }
    _tile_loadconfig(&c);
}

static const int64_t AMX_BLOCK = 16;

// a call of more than 16 rows: xq (m, k) -> rows padded with zeros to a multiple of 16 (nullptr when m is one: read
// xq itself), each block of 16 on tiles of 16 rows
static int8_t* padded_rows(const int8_t* xq, int64_t m, int64_t k) {
    if (m <= AMX_BLOCK || m % AMX_BLOCK == 0) return nullptr;
    const int64_t mp = (m + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK;
    int8_t* out = new int8_t[mp * k];
    std::memcpy(out, xq, m * k);
    std::memset(out + m * k, 0, (mp - m) * k);
    return out;
}

// the 16 x 16 sums of four consecutive groups of 32 inputs: activations at x (stride k; group i at x + 32 i),
// weights w[i] (8 x 64 bytes each) -> c (4 x 16 rows x 16 int32)
static inline void four_group_sums(const int8_t* x, int64_t k, const void* const w[4], int32_t* c) {
#define PACER_GROUP(i, a, b)                 \
    _tile_zero(i);                           \
    _tile_loadd(a, x + 32 * i, k);           \
    _tile_loadd(b, w[i], 64);                \
    _tile_dpbsud(i, a, b);
    PACER_GROUP(0, 4, 6)
    PACER_GROUP(1, 5, 7)
    PACER_GROUP(2, 4, 6)
    PACER_GROUP(3, 5, 7)
#undef PACER_GROUP
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

// q4_tile's arithmetic for 16 rows (rows < 16 of them kept), the sums of each group from the tiles
static void q4_tile_amx(const uint8_t* packed, const uint8_t* sc, const uint8_t* mn, const uint16_t* dd,
                        const int8_t* xq, const float* sx, const int16_t* xs, int64_t k, int64_t blocks, int64_t rows,
                        float* out, int64_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    alignas(64) uint8_t w[4][512];
    const void* const wp[4] = {w[0], w[1], w[2], w[3]};
    alignas(64) int32_t c[4 * 16 * 16];
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i iacc[16];
        for (int r = 0; r < 16; ++r) iacc[r] = _mm512_setzero_si512();
        for (int half = 0; half < 2; ++half) {
            for (int i = 0; i < 4; ++i) {
                const uint8_t* p = packed + ((b * 8 + half * 4 + i) * 256);
                _mm_prefetch((const char*)(p + PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char*)(p + PREFETCH + 64), _MM_HINT_T0);
                _mm_prefetch((const char*)(p + PREFETCH + 128), _MM_HINT_T0);
                _mm_prefetch((const char*)(p + PREFETCH + 192), _MM_HINT_T0);
                for (int j = 0; j < 4; ++j) {
                    const __m512i v = _mm512_loadu_si512((const void*)(p + j * 64));
                    _mm512_store_si512((void*)(w[i] + j * 64), _mm512_and_si512(v, low));
                    _mm512_store_si512((void*)(w[i] + (j + 4) * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            }
            four_group_sums(xq + b * 256 + half * 128, k, wp, c);
            for (int i = 0; i < 4; ++i) {
                const int g = half * 4 + i;
                const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + (b * 8 + g) * 16)));
                for (int64_t r = 0; r < rows; ++r)
                    iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(_mm512_load_si512((const void*)(c + 256 * i + 16 * r)), scv));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32)));
        const __m512 dminv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32 + 16)));
        for (int64_t r = 0; r < rows; ++r) {  // as q4_tile
            const int16_t* xsr = xs + r * (k / 32) + b * 8;
            __m512i msum = _mm512_setzero_si512();
            for (int q = 0; q < 4; ++q) {
                const __m512i mnq = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(mn + (b * 4 + q) * 32)));
                msum = _mm512_dpwssd_epi32(msum, mnq, _mm512_set1_epi32(load4((const int8_t*)(xsr + 2 * q))));
            }
            __m512 t = _mm512_sub_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(iacc[r])),
                                     _mm512_mul_ps(dminv, _mm512_cvtepi32_ps(msum)));
            float* o = out + r * ldo;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(_mm512_set1_ps(sx[r * blocks + b]), t)));
        }
    }
}

// A call of more than 16 rows (a prompt), its rows padded to a multiple of 16. Each group's 6-bit scale is split,
// sc = 8 hi + lo (hi, lo in 0..7), and folded into two copies of the group's weights, hi * q and lo * q (at most
// 105: a byte), built once per super-block of the tile for all the row blocks. The tiles then sum a super-block's
// 256 inputs in two accumulators, 64 inputs a product, and
//   sum_g sc_g sum_{i in g} x_i q_i = 8 sum_i x_i (hi q)_i + sum_i x_i (lo q)_i,
// exactly (integers; at most 256 x 127 x 105 in magnitude): the same sums as q4_tile's, then its float work per row.
// Tiles: 0-1 the sums (hi, lo; 16 rows x 16 int32), 2-3 activations (16 rows x 64 bytes), 4-5 and 6-7 the scaled
// weights (16 rows x 64 bytes: two groups' 8 steps).
static void tile_config_prompt() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
}

// bytes q (0..15) times per-output factors s (0..7; 16-bit lanes, each output's factor in both of its lanes)
static inline __m512i scale_codes(__m512i q, __m512i s) {
    const __m512i even = _mm512_mullo_epi16(_mm512_and_si512(q, _mm512_set1_epi16(0x00FF)), s);
    const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(q, 8), s);
    return _mm512_or_si512(even, _mm512_slli_epi16(odd, 8));
}

// super-blocks [b0, b1) of a call of m rows (a multiple of 16) into out: m x 16 floats (stride 16), zeroed before
// the first super-block; rows_kept of them kept
static void q4_rows_amx(const uint8_t* packed, const uint8_t* sc, const uint8_t* mn, const uint16_t* dd,
                        const int8_t* xq, const float* sx, const int16_t* xs, int64_t k, int64_t blocks, int64_t b0,
                        int64_t b1, int64_t m, int64_t rows_kept, float* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    alignas(64) uint8_t whi[8 * 512], wlo[8 * 512];  // per group: 8 steps x 16 outputs x 4 inputs
    alignas(64) int32_t c[2 * 16 * 16];
    for (int64_t b = b0; b < b1; ++b) {
        for (int g = 0; g < 8; ++g) {
            const __m128i scg = _mm_loadu_si128((const __m128i*)(sc + (b * 8 + g) * 16));
            const __m128i hi8 = _mm_and_si128(_mm_srli_epi16(scg, 3), _mm_set1_epi8(7));
            const __m128i lo8 = _mm_and_si128(scg, _mm_set1_epi8(7));
            const __m512i hi32 = _mm512_cvtepu8_epi32(hi8), lo32 = _mm512_cvtepu8_epi32(lo8);
            const __m512i shi = _mm512_or_si512(hi32, _mm512_slli_epi32(hi32, 16));
            const __m512i slo = _mm512_or_si512(lo32, _mm512_slli_epi32(lo32, 16));
            const uint8_t* p = packed + ((b * 8 + g) * 256);
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512((const void*)(p + j * 64));
                const __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                _mm512_store_si512((void*)(whi + g * 512 + j * 64), scale_codes(q0, shi));
                _mm512_store_si512((void*)(whi + g * 512 + (j + 4) * 64), scale_codes(q1, shi));
                _mm512_store_si512((void*)(wlo + g * 512 + j * 64), scale_codes(q0, slo));
                _mm512_store_si512((void*)(wlo + g * 512 + (j + 4) * 64), scale_codes(q1, slo));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32)));
        const __m512 dminv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + b * 32 + 16)));
        __m512i mnq[4];  // the super-block's group minima, as every row's min term reads them
        for (int q = 0; q < 4; ++q)
            mnq[q] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(mn + (b * 4 + q) * 32)));
        for (int64_t r0 = 0; r0 < m; r0 += AMX_BLOCK) {
            const int8_t* x = xq + r0 * k + b * 256;
            _tile_zero(0);
            _tile_zero(1);
#define PACER_PAIR(j, a, bh, bl)                 \
    _tile_loadd(a, x + 64 * j, k);               \
    _tile_loadd(bh, whi + 1024 * j, 64);         \
    _tile_loadd(bl, wlo + 1024 * j, 64);         \
    _tile_dpbsud(0, a, bh);                      \
    _tile_dpbsud(1, a, bl);
            PACER_PAIR(0, 2, 4, 6)
            PACER_PAIR(1, 3, 5, 7)
            PACER_PAIR(2, 2, 4, 6)
            PACER_PAIR(3, 3, 5, 7)
#undef PACER_PAIR
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
            const int64_t end = r0 + AMX_BLOCK < rows_kept ? r0 + AMX_BLOCK : rows_kept;
            for (int64_t r = r0; r < end; ++r) {  // as q4_tile
                const int32_t* cr = c + 16 * (r - r0);
                const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)cr), 3),
                                                      _mm512_load_si512((const void*)(cr + 256)));
                const int16_t* xsr = xs + r * (k / 32) + b * 8;
                __m512i msum = _mm512_setzero_si512();
                for (int q = 0; q < 4; ++q)
                    msum = _mm512_dpwssd_epi32(msum, mnq[q], _mm512_set1_epi32(load4((const int8_t*)(xsr + 2 * q))));
                __m512 t = _mm512_sub_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(isum)),
                                         _mm512_mul_ps(dminv, _mm512_cvtepi32_ps(msum)));
                float* o = out + r * 16;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(_mm512_set1_ps(sx[r * blocks + b]), t)));
            }
        }
    }
}

// q8_tile's arithmetic for 16 rows (rows < 16 of them kept), over the groups [g_begin, g_end) of 32 inputs: sums
// (rows x 16 floats, stride 16) holds each row's running sum, zero before the first group; the caller multiplies
// by the outputs' scales after the last (as q8_tile does). The packed int8 weights are tile B as they lie. k is a
// multiple of 128 (the target's layers: of 256), and so are the group bounds' inputs.
static void q8_tile_amx(const uint8_t* packed, const int8_t* xq, const float* sx, const int16_t* xs, int64_t k,
                        int64_t g_begin, int64_t g_end, int64_t rows, float* sums) {
    alignas(64) int32_t c[4 * 16 * 16];
    __m512 acc[16];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_loadu_ps(sums + 16 * r);
    for (int64_t g0 = g_begin; g0 < g_end; g0 += 4) {
        const uint8_t* p = packed + g0 * 512;
        for (int j = 0; j < 32; ++j) _mm_prefetch((const char*)(p + j * 64 + PREFETCH), _MM_HINT_T0);
        const void* const wp[4] = {p, p + 512, p + 1024, p + 1536};
        four_group_sums(xq + g0 * 32, k, wp, c);
        for (int i = 0; i < 4; ++i) {
            const int64_t g = g0 + i;
            for (int64_t r = 0; r < rows; ++r) {  // as q8_tile
                const __m512i s = _mm512_load_si512((const void*)(c + 256 * i + 16 * r));
                const __m512i exact = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * int32_t(xs[r * (k / 32) + g])));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(sx[r * (k / 32) + g]), _mm512_cvtepi32_ps(exact)));
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}

// sums (rows x 16, stride 16) times the tile's output scales, in place
static void scale_sums(float* sums, int64_t rows, const float* scale) {
    const __m512 sv = _mm512_loadu_ps(scale);
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(sums + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(sums + 16 * r), sv));
}

static bool use_amx(int64_t m, int64_t k) { return amx_rows > 0 && m >= amx_rows && k % 128 == 0 && amx_permitted(); }

extern "C" int pacer_amx_available() { return amx_permitted() ? 1 : 0; }
#else
static bool use_amx(int64_t, int64_t) { return false; }
extern "C" int pacer_amx_available() { return 0; }
#endif

// Calls of at least `rows` rows use the AMX tiles where this build and process have them; 0: never; negative: left
// as it is. Returns the previous setting (0 where there are no tiles; a row's results are the same bits either way).
extern "C" int64_t pacer_set_amx_rows(int64_t rows) {
#ifdef PACER_AMX
    const int64_t previous = amx_permitted() ? amx_rows : 0;
    if (rows >= 0) amx_rows = rows;
    return previous;
#else
    (void)rows;
    return 0;
#endif
}

#ifdef PACER_AMX
// A prompt's activations are read again for every output tile: where all of them (mp rows x k bytes) would not stay
// in a core's L2 cache beside the weights, the tiles go over the inputs in chunks whose activations do (each tile's
// outputs kept between chunks; a row's float sums still added block after block of inputs, in order). Returns the
// chunk's inputs: a multiple of `step` (the kernel's block of inputs), at least one.
static const int64_t PROMPT_CACHE_BYTES = 512 * 1024;
static int64_t prompt_chunk(int64_t mp, int64_t k, int64_t step) {
    const int64_t fit = PROMPT_CACHE_BYTES / (mp * step) * step;
    return fit < step ? step : fit > k ? k : fit;
}
#endif

// A tile's float results (rows x 16 in acc) plus the bias, to out (float, or bf16 rounded to nearest even as
// torch's conversion rounds; NaN stays NaN).
static void finish(const float* acc, int64_t rows, const float* bias, void* out, int out_bf16, int64_t offset,
                   int64_t ldo) {
    for (int64_t r = 0; r < rows; ++r) {
        __m512 v = _mm512_loadu_ps(acc + r * 16);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        if (out_bf16) {
            const __m512i bits = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
            rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
            _mm256_storeu_si256((__m256i*)((uint16_t*)out + offset + r * ldo), _mm512_cvtepi32_epi16(rounded));
        } else {
            _mm512_storeu_ps((float*)out + offset + r * ldo, v);
        }
    }
}

#define PACER_ROWS(F, ...)                                                  \
    switch (rows) {                                                         \
        case 1: F<1>(__VA_ARGS__); break; case 2: F<2>(__VA_ARGS__); break; \
        case 3: F<3>(__VA_ARGS__); break; case 4: F<4>(__VA_ARGS__); break; \
        case 5: F<5>(__VA_ARGS__); break; case 6: F<6>(__VA_ARGS__); break; \
        case 7: F<7>(__VA_ARGS__); break; default: F<8>(__VA_ARGS__); break; \
    }
static const int64_t ROW_BLOCK = 8;

// out: (m, n), float or (out_bf16) bf16, plus bias (n floats) unless null. xq, sx, xs from pacer_quantize_rows
// with block 256.
extern "C" void pacer_q4k_matmul(const uint8_t* packed, const uint8_t* sc, const uint8_t* mn, const uint16_t* dd,
                                 int64_t n, int64_t k, const int8_t* xq, const float* sx,
                                 const int16_t* xs, int64_t m, const float* bias, int out_bf16, void* out) {
    const int64_t tiles = n / 16, blocks = k / 256;
#ifdef PACER_AMX
    if (use_amx(m, k)) {
        int8_t* pad = padded_rows(xq, m, k);
        const int8_t* x = pad ? pad : xq;
        const int64_t mp = (m + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK;
        if (m > AMX_BLOCK) {  // a prompt: its rows' outputs per tile, over chunks of super-blocks (prompt_chunk)
            const int64_t chunk = prompt_chunk(mp, k, 256) / 256;  // super-blocks
            const bool one = chunk == blocks;  // one chunk: a tile's outputs done before the next tile's start
            const int64_t size = mp * 16 * sizeof(float);
            float* many = one ? nullptr : static_cast<float*>(std::aligned_alloc(64, tiles * size));
#pragma omp parallel
            {
                tile_config_prompt();
                float* mine = one ? static_cast<float*>(std::aligned_alloc(64, size)) : nullptr;
                for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
                    const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < tiles; ++t) {
                        float* acc = one ? mine : many + t * mp * 16;
                        if (b0 == 0) std::memset(acc, 0, size);
                        q4_rows_amx(packed + t * blocks * 8 * 256, sc + t * blocks * 8 * 16, mn + t * blocks * 8 * 16,
                                    dd + t * blocks * 32, x, sx, xs, k, blocks, b0, b1, mp, m, acc);
                        if (b1 == blocks) finish(acc, m, bias ? bias + t * 16 : nullptr, out, out_bf16, t * 16, n);
                    }
                }
                _tile_release();
                std::free(mine);
            }
            std::free(many);
            delete[] pad;
            return;
        }
#pragma omp parallel
        {
            tile_config(m);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                alignas(64) float acc[AMX_BLOCK * 16];
                std::memset(acc, 0, sizeof acc);
                q4_tile_amx(packed + t * blocks * 8 * 256, sc + t * blocks * 8 * 16, mn + t * blocks * 8 * 16,
                            dd + t * blocks * 32, x, sx, xs, k, blocks, m, acc, 16);
                finish(acc, m, bias ? bias + t * 16 : nullptr, out, out_bf16, t * 16, n);
            }
            _tile_release();
        }
        delete[] pad;
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* pt = packed + t * blocks * 8 * 256;
        const uint8_t* sct = sc + t * blocks * 8 * 16;
        const uint8_t* mnt = mn + t * blocks * 8 * 16;
        const uint16_t* ddt = dd + t * blocks * 32;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            float acc[ROW_BLOCK * 16];
            std::memset(acc, 0, sizeof acc);
            PACER_ROWS(q4_tile, pt, sct, mnt, ddt, xq + r0 * k, sx + r0 * blocks, xs + r0 * (k / 32), k, blocks, acc, 16)
            finish(acc, rows, bias ? bias + t * 16 : nullptr, out, out_bf16, r0 * n + t * 16, n);
        }
    }
}

// out and bias as pacer_q4k_matmul's; xq, sx, xs from pacer_quantize_rows with block 32.
extern "C" void pacer_q8_matmul(const uint8_t* packed, const float* scale, int64_t n, int64_t k, const int8_t* xq,
                                const float* sx, const int16_t* xs, int64_t m, const float* bias, int out_bf16,
                                void* out) {
    const int64_t tiles = n / 16;
#ifdef PACER_AMX
    if (use_amx(m, k)) {
        int8_t* pad = padded_rows(xq, m, k);
        const int8_t* x = pad ? pad : xq;
        const int64_t mp = (m + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK, groups = k / 32;
        // a prompt over chunks of inputs (prompt_chunk), its rows' running sums per tile between them
        const int64_t chunk = m > AMX_BLOCK ? prompt_chunk(mp, k, 128) : k;
        const bool one = chunk == k;
        const int64_t size = mp * 16 * sizeof(float);
        float* many = one ? nullptr : static_cast<float*>(std::aligned_alloc(64, tiles * size));
#pragma omp parallel
        {
            tile_config(m < AMX_BLOCK ? m : AMX_BLOCK);
            float* mine = one ? static_cast<float*>(std::aligned_alloc(64, size)) : nullptr;
            for (int64_t i0 = 0; i0 < k; i0 += chunk) {
                const int64_t i1 = i0 + chunk < k ? i0 + chunk : k;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < tiles; ++t) {
                    float* sums = one ? mine : many + t * mp * 16;
                    if (i0 == 0) std::memset(sums, 0, size);
                    for (int64_t r0 = 0; r0 < m; r0 += AMX_BLOCK) {
                        const int64_t rows = m - r0 < AMX_BLOCK ? m - r0 : AMX_BLOCK;
                        q8_tile_amx(packed + t * k * 16, x + r0 * k, sx + r0 * groups, xs + r0 * groups, k, i0 / 32,
                                    i1 / 32, rows, sums + r0 * 16);
                    }
                    if (i1 == k) {
                        scale_sums(sums, m, scale + t * 16);
                        finish(sums, m, bias ? bias + t * 16 : nullptr, out, out_bf16, t * 16, n);
                    }
                }
            }
            _tile_release();
            std::free(mine);
        }
        std::free(many);
        delete[] pad;
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            float acc[ROW_BLOCK * 16];
            PACER_ROWS(q8_tile, packed + t * k * 16, scale + t * 16, xq + r0 * k, sx + r0 * (k / 32), xs + r0 * (k / 32),
                       k, acc, 16)
            finish(acc, rows, bias ? bias + t * 16 : nullptr, out, out_bf16, r0 * n + t * 16, n);
        }
    }
}

// int4 weights with int8 activations (a draft's decoding steps: torch's int4 kernel, which converts every weight to
// float, spends about twice the memory's time on a small draft's layers at one row; bf16 dot products over a table
// lookup of the codes were compute-bound too, at about half the speed of this). Weights as torch's int4 kernel defines them:
// w = (q - 8) * s + z, q in 0..15, s and z bf16 per output and group of 32 inputs; activations quantized per row in
// blocks of 32 (pacer_quantize_rows: xq, sx, xs). For tile t (16 outputs) and group g: packed[t][g][4][64], zmm p
// holding step p in its low nibbles and step p + 4 in its high ones (step j: inputs 4j..4j+3 of the group for the 16
// outputs, 4 codes per output), as q4_tile reads them; sz[t][g][2][16] (bf16 bits: s, then z). Per row and output,
// with the integer sums exact, in this order for every row whatever the call's size (each row has its own sums):
//   y = sum_g sx_g * (s_g * (sum_{i in g} xq_i q_i - 8 xs_g) + z_g * xs_g)
template <int R>
static void i4_tile(const uint8_t* packed, const uint16_t* sz, const int8_t* xq, const float* sx, const int16_t* xs,
                    int64_t k, float* out) {
    const int64_t groups = k / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = packed + g * 256;
        _mm_prefetch((const char*)(p + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char*)(p + PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char*)(p + PREFETCH + 128), _MM_HINT_T0);
        _mm_prefetch((const char*)(p + PREFETCH + 192), _MM_HINT_T0);
        __m512i w[8];
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512((const void*)(p + j * 64));
            w[j] = _mm512_and_si512(v, low);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sz + g * 32))), 16));
        const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sz + g * 32 + 16))), 16));
        for (int r = 0; r < R; ++r) {
            const int8_t* xr = xq + r * k + g * 32;
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(load4(xr)));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(load4(xr + 4)));
            for (int j = 2; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load4(xr + 4 * j)));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(load4(xr + 4 * j + 4)));
            }
            const int32_t total = xs[r * groups + g];
            const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(8 * total));
            const __m512 t = _mm512_add_ps(_mm512_mul_ps(s, _mm512_cvtepi32_ps(centred)),
                                           _mm512_mul_ps(z, _mm512_set1_ps(float(total))));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(sx[r * groups + g]), t));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// out: (m, n), float or (out_bf16) bf16, plus bias (n floats) unless null; xq, sx, xs from pacer_quantize_rows with
// block 32.
#ifdef PACER_AMX
// i4_tile's arithmetic for a call of more than 16 rows (a draft's prompt), its rows padded to a multiple of 16 (m):
// four groups of the tile's weights unpacked at a time, once for all the row blocks; each group's sums from the tiles,
// then per row, groups in ascending order as i4_tile adds them, acc += sx_g * (s_g * (sum - 8 xs_g) + z_g * xs_g).
// out: rows_kept x 16 floats (stride 16), zeroed.
static void i4_rows_amx(const uint8_t* packed, const uint16_t* sz, const int8_t* xq, const float* sx, const int16_t* xs,
                        int64_t k, int64_t m, int64_t rows_kept, float* out) {
    const int64_t groups = k / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    alignas(64) uint8_t w[4][512];
    const void* const wp[4] = {w[0], w[1], w[2], w[3]};
    alignas(64) int32_t c[4 * 16 * 16];
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        __m512 s[4], z[4];
        for (int i = 0; i < 4; ++i) {
            const uint8_t* p = packed + (g0 + i) * 256;
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512((const void*)(p + j * 64));
                _mm512_store_si512((void*)(w[i] + j * 64), _mm512_and_si512(v, low));
                _mm512_store_si512((void*)(w[i] + (j + 4) * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
            s[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sz + (g0 + i) * 32))), 16));
            z[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sz + (g0 + i) * 32 + 16))), 16));
        }
        for (int64_t r0 = 0; r0 < m; r0 += AMX_BLOCK) {
            four_group_sums(xq + r0 * k + g0 * 32, k, wp, c);
            const int64_t end = rows_kept < r0 + AMX_BLOCK ? rows_kept : r0 + AMX_BLOCK;
            for (int64_t r = r0; r < end; ++r) {
                __m512 acc = _mm512_loadu_ps(out + r * 16);
                for (int i = 0; i < 4; ++i) {  // as i4_tile, group after group
                    const int32_t total = xs[r * groups + g0 + i];
                    const __m512i sum = _mm512_load_si512((const void*)(c + 256 * i + 16 * (r - r0)));
                    const __m512i centred = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * total));
                    const __m512 t = _mm512_add_ps(_mm512_mul_ps(s[i], _mm512_cvtepi32_ps(centred)),
                                                   _mm512_mul_ps(z[i], _mm512_set1_ps(float(total))));
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(sx[r * groups + g0 + i]), t));
                }
                _mm512_storeu_ps(out + r * 16, acc);
            }
        }
    }
}
#endif

extern "C" void pacer_i4_matmul(const uint8_t* packed, const uint16_t* sz, int64_t n, int64_t k, const int8_t* xq,
                                const float* sx, const int16_t* xs, int64_t m, const float* bias, int out_bf16,
                                void* out) {
    const int64_t tiles = n / 16, groups = k / 32;
#ifdef PACER_AMX
    if (m > AMX_BLOCK && use_amx(m, k)) {  // a prompt; fewer rows (a step, a catch-up) stay on VNNI
        int8_t* pad = padded_rows(xq, m, k);
        const int8_t* x = pad ? pad : xq;
        const int64_t mp = (m + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK;
#pragma omp parallel
        {
            tile_config(AMX_BLOCK);
            float* many = static_cast<float*>(std::aligned_alloc(64, m * 16 * sizeof(float)));
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                std::memset(many, 0, m * 16 * sizeof(float));
                i4_rows_amx(packed + t * groups * 256, sz + t * groups * 32, x, sx, xs, k, mp, m, many);
                finish(many, m, bias ? bias + t * 16 : nullptr, out, out_bf16, t * 16, n);
            }
            _tile_release();
            std::free(many);
        }
        delete[] pad;
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            float acc[ROW_BLOCK * 16];
            PACER_ROWS(i4_tile, packed + t * groups * 256, sz + t * groups * 32, xq + r0 * k, sx + r0 * groups,
                       xs + r0 * groups, k, acc)
            finish(acc, rows, bias ? bias + t * 16 : nullptr, out, out_bf16, r0 * n + t * 16, n);
        }
    }
}

// A draft's prompt on bf16 tiles (Int4Linear(prompt_tiles=True); AMX-BF16 and AVX512-BF16): the int8 path above
// spends most of a prompt's time scaling each group's integer sums row by row in float (torch's int4 format has a
// float scale and zero every 32 inputs). Here each tile's weights are dequantized once a call, w = (q - 8) * s + z
// rounded to bf16 (the grid's own values, as Int4Linear's dense copy holds them), and the bf16 rows of the prompt
// (not quantized) are multiplied on the tiles (tdpbf16ps: 16 rows x 32 inputs against 32 inputs x 16 outputs, float
// sums), each output's sum kept in its tile over all the inputs: no work per group and row. The numbers are not the
// int8 path's (a draft's choice: they change which tokens it proposes, never the output); each row's are its own,
// the same instructions in the same order whatever the call (rows past 16) or the thread count.
#if defined(PACER_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PACER_BF16_TILES 1

// one group (32 inputs) of a tile of 16 outputs: packed (256 bytes, as i4_tile reads them), sz (s[16], z[16] bf16
// bits) -> b: tile B for tdpbf16ps, 16 rows x 16 outputs x 2 bf16 (row i: inputs 2i, 2i + 1 of each output)
static void i4_group_bf16(const uint8_t* packed, const uint16_t* sz, uint16_t* b) {
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)sz)), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sz + 16))), 16));
    const __m512i low = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
    for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512((const void*)(packed + j * 64));
        for (int half = 0; half < 2; ++half) {  // step j (low nibbles), step j + 4 (high)
            const int step = j + 4 * half;
            __m512i w[4];  // input 4 step + i of each output, as bf16 bits in 32-bit lanes
            for (int i = 0; i < 4; ++i) {
                const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i + 4 * half), low);
                const __m512 f = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, eight)), s), z);
                w[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f));
            }
            _mm512_store_si512((void*)(b + (2 * step) * 32), _mm512_or_si512(w[0], _mm512_slli_epi32(w[1], 16)));
            _mm512_store_si512((void*)(b + (2 * step + 1) * 32), _mm512_or_si512(w[2], _mm512_slli_epi32(w[3], 16)));
        }
    }
}

// tiles 0-3: sums (16 rows x 16 floats) of row blocks 0/1 x output tiles 0/1; 4-5: the two row blocks' activations
// (16 rows x 32 bf16); 6-7: the two output tiles' weights (16 rows x 64 bytes). Four independent chains of products,
// each weight and activation tile loaded once for two products.
static void tile_config_bf16() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
}

extern "C" int pacer_bf16_tiles_available() { return amx_permitted() ? 1 : 0; }

// x: (m, k) bf16; out and bias as pacer_i4_matmul's. k a multiple of 32, n of 16.
extern "C" void pacer_i4_matmul_bf16(const uint8_t* packed, const uint16_t* sz, int64_t n, int64_t k, const uint16_t* x,
                                     int64_t m, const float* bias, int out_bf16, void* out) {
    const int64_t tiles = n / 16, groups = k / 32, mp = (m + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK;
    uint16_t* pad = nullptr;  // rows past the call's end read zeros
    if (mp != m) {
        pad = new uint16_t[mp * k];
        std::memcpy(pad, x, m * k * sizeof(uint16_t));
        std::memset(pad + m * k, 0, (mp - m) * k * sizeof(uint16_t));
    }
    const uint16_t* xa = pad ? pad : x;
    const int64_t lda = k * sizeof(uint16_t);
#pragma omp parallel
    {
        tile_config_bf16();
        uint16_t* wb = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * groups * 512 * sizeof(uint16_t)));
        alignas(64) float c[4][16 * 16];
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (tiles + 1) / 2; ++pair) {
            const int64_t t0 = 2 * pair;
            const bool two_tiles = t0 + 1 < tiles;
            uint16_t* w0 = wb;
            uint16_t* w1 = wb + groups * 512;
            for (int64_t g = 0; g < groups; ++g) {
                i4_group_bf16(packed + (t0 * groups + g) * 256, sz + (t0 * groups + g) * 32, w0 + g * 512);
                if (two_tiles)
                    i4_group_bf16(packed + ((t0 + 1) * groups + g) * 256, sz + ((t0 + 1) * groups + g) * 32, w1 + g * 512);
            }
            for (int64_t r0 = 0; r0 < mp; r0 += 2 * AMX_BLOCK) {
                const bool two_blocks = r0 + AMX_BLOCK < mp;
                const uint16_t* a0 = xa + r0 * k;
                const uint16_t* a1 = a0 + AMX_BLOCK * k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t g = 0; g < groups; ++g) {
                    _tile_loadd(6, w0 + g * 512, 64);
                    _tile_loadd(4, a0 + g * 32, lda);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_tiles) {
                        _tile_loadd(7, w1 + g * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two_blocks) {
                        _tile_loadd(5, a1 + g * 32, lda);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two_tiles) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                for (int blk = 0; blk < (two_blocks ? 2 : 1); ++blk) {
                    const int64_t first = r0 + blk * AMX_BLOCK;
                    if (first >= m) break;
                    const int64_t rows = m - first < AMX_BLOCK ? m - first : AMX_BLOCK;
                    for (int tt = 0; tt < (two_tiles ? 2 : 1); ++tt)
                        finish(c[2 * blk + tt], rows, bias ? bias + (t0 + tt) * 16 : nullptr, out, out_bf16,
                               first * n + (t0 + tt) * 16, n);
                }
            }
        }
        _tile_release();
        std::free(wb);
    }
    delete[] pad;
}
#else
extern "C" int pacer_bf16_tiles_available() { return 0; }
extern "C" void pacer_i4_matmul_bf16(const uint8_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                                     const float*, int, void*) {}
#endif

// A decoder layer (Llama / Qwen2: RMSNorm, rotary embeddings by rotate_half, grouped-query attention, a SiLU-gated
// MLP) in two calls: the eager layer runs about forty small torch operators, each a few microseconds of dispatch,
// where the arithmetic of a decoding step's row takes less. Every linear layer is read by its kernel above, once for
// all the rows; every intermediate is rounded to bf16 where transformers' eager bf16 layer rounds it, so the layer
// follows the eager one's numerics closely (not bitwise: the norm's float sum and the SiLU's exp run in another
// order). Each row is computed alone (row-invariant kernels, norms and attention row by row), so a call of any number
// of tokens gives bitwise what one-token calls give.
static inline float bf2f(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {  // round to nearest even, as torch converts; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

// 16 floats rounded to bf16 as f2bf rounds them (nearest even, NaN stays NaN), as 16-bit codes
static inline __m256i f2bf_ps(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
}

static inline __m512 bf2f_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// the first min(n, 16) lanes: a loop's last, partial step over n elements
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// e^x for 16 floats (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its degree-7 polynomial, then 2^n by
// scalef; within 2 ulp of e^x, infinity past 88.7, zero below -104, NaN kept). The MLP's SiLU took a scalar expf a
// hidden unit: about a seventh of a prompt's time.
static inline __m512 exp_ps(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 poly = _mm512_set1_ps(1.9875691500E-4f);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507E-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073E-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894E-2f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459E-1f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201E-1f));
    poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 e = _mm512_scalef_ps(poly, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);
}

// one row of the MLP's activation: out = bf16(bf16(silu(gate)) * up), 16 hidden units at a time (a masked last
// step: every unit of every row goes through the same instructions)
static void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes(n - i);
        const __m512 g = bf2f_ps(_mm256_maskz_loadu_epi16(mask, gate + i));
        const __m512 u = bf2f_ps(_mm256_maskz_loadu_epi16(mask, up + i));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        const __m512 rounded = bf2f_ps(f2bf_ps(silu));
        _mm256_mask_storeu_epi16(out + i, mask, f2bf_ps(_mm512_mul_ps(rounded, u)));
    }
}

// Attention for causal decoders, one query row at a time (pacer_exact's rule: a row's result must not depend on
// the rows computed with it). q (B, H, M, D) bf16, contiguous; k and v (B, KV, L, D) bf16, each head's L rows of D
// contiguous and `kv_stride` elements apart (L * D where the tensors are contiguous; a cache's capacity times D where
// they are the first L positions of a longer buffer); row (b, i) attends to keys lo[b, i]..hi[b, i] - 1 (hi == lo: a
// padding row, zeros); GQA: query head h reads key head h / (H / KV). out (B, M, H, D) float.
// A task is one row and one key/value head with all its query heads (up to 8 at a time): each block of 16 keys is read
// into L1 once for all of them, each value widened from bf16 once. In float32, in this order for every row and query
// head, whatever else the call holds (so a row's bits are its single-row call's):
//   s_j = (q . k_j: 16 lanes over the head's dimension, then sum_lanes16's fixed tree) * scaling   (scores16)
//   p_j = exp_ps(s_j - max s), 16 keys at a time counted from the row's first key
//   total = sum of p_j: 16 lane sums (lane t: keys first + t, first + 16 + t, ...), then a fixed horizontal sum
//   out = (sum_j p_j v_j, j ascending, a lane per dimension) / total
// It took a task per query head, libm's expf a key and a horizontal sum a score: 2.5-3x this time at 8 rows of 400 keys.

// the 16 lanes of each of a[0..15] summed into lane x of the result, by a fixed tree: lanes (l, l + 2) of each 128-bit
// block, then (l, l + 1), then blocks (0, 1) and (2, 3), then the two pairs
static inline __m512 sum_lanes16(const __m512* a) {
    __m512 b[8], c[4];
    for (int x = 0; x < 8; ++x)
        b[x] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * x], a[2 * x + 1]), _mm512_unpackhi_ps(a[2 * x], a[2 * x + 1]));
    for (int x = 0; x < 4; ++x) {
        const __m512d l = _mm512_castps_pd(b[2 * x]), r = _mm512_castps_pd(b[2 * x + 1]);
        c[x] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(l, r)), _mm512_castpd_ps(_mm512_unpackhi_pd(l, r)));
    }
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores of one query head against keys kh[0 .. nb - 1] (nb <= 16), times `scaling`, into s[0 .. nb - 1]: each key's
// products summed in 16 lanes over the head's dimension (bf16 pairs by vdpbf16ps where the CPU has it, else widened to
// float and fused multiply-adds), then the lanes by sum_lanes16. P: the head's dimension in 32s, rounded up (D <= 32 P)
template <int P>
static inline void scores16(const uint16_t* qr, const float* qf, const uint16_t* kh, int64_t nb, int64_t D,
                            float scaling, float* s) {
    __m512 acc[16];
#ifdef __AVX512BF16__
    (void)qf;
    __m512bh qv[P];
    __mmask32 dims[P];
    for (int c = 0; c < P; ++c) {
        const int64_t left = D - 32 * c;  // dimensions in this pair of chunks: 32, fewer (the last), none (past it)
        dims[c] = left >= 32 ? __mmask32(0xFFFFFFFFu) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
        qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(dims[c], qr + 32 * c);
    }
    if (nb == 16 && D == 32 * P) {  // a whole block (every block but a row's last): no masks
        for (int x = 0; x < 16; x += 4) {
            __m512 a[4];
            for (int y = 0; y < 4; ++y) a[y] = _mm512_setzero_ps();
            for (int c = 0; c < P; ++c)
                for (int y = 0; y < 4; ++y)
                    a[y] = _mm512_dpbf16_ps(a[y], qv[c], (__m512bh)_mm512_loadu_si512(kh + (x + y) * D + 32 * c));
            for (int y = 0; y < 4; ++y) acc[x + y] = a[y];
        }
    } else
    for (int x = 0; x < 16; x += 4) {  // four keys at a time: four independent chains
        __m512 a[4];
        __mmask32 live[4];
        for (int y = 0; y < 4; ++y) {
            a[y] = _mm512_setzero_ps();
            live[y] = x + y < nb ? __mmask32(0xFFFFFFFFu) : __mmask32(0);  // past the last key: nothing read, zeros
        }
        for (int c = 0; c < P; ++c)
            for (int y = 0; y < 4; ++y)
                a[y] = _mm512_dpbf16_ps(a[y], qv[c],
                                        (__m512bh)_mm512_maskz_loadu_epi16(dims[c] & live[y], kh + (x + y) * D + 32 * c));
        for (int y = 0; y < 4; ++y) acc[x + y] = a[y];
    }
#else
    (void)qr;
    for (int x = 0; x < 16; x += 4) {
        __m512 a[4];
        __mmask16 live[4];
        for (int y = 0; y < 4; ++y) {
            a[y] = _mm512_setzero_ps();
            live[y] = x + y < nb ? __mmask16(0xFFFF) : __mmask16(0);
        }
        for (int c = 0; c < 2 * P; ++c) {
            if (16 * c >= D) break;
            const __m512 qc = _mm512_loadu_ps(qf + 16 * c);
            for (int y = 0; y < 4; ++y)
                a[y] = _mm512_fmadd_ps(qc, bf2f_ps(_mm256_maskz_loadu_epi16(live[y], kh + (x + y) * D + 16 * c)), a[y]);
        }
        for (int y = 0; y < 4; ++y) acc[x + y] = a[y];
    }
#endif
    _mm512_mask_storeu_ps(s, first_lanes(nb), _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scaling)));
}

template <int NH>
static void attend_heads(const uint16_t* const* qr, const float* qf, const uint16_t* kh, const uint16_t* vh,
                         int64_t n, int64_t D, float scaling, float* s, float* o) {
    const int64_t chunks = D / 16;
    auto scores = D <= 64 ? scores16<2> : D <= 128 ? scores16<4> : scores16<8>;
    for (int64_t j = 0; j < n; j += 16)  // a block of keys stays in L1 for the heads
        for (int t = 0; t < NH; ++t)
            scores(qr[t], qf + t * D, kh + j * D, n - j < 16 ? n - j : 16, D, scaling, s + t * n + j);
    float total[NH];
    for (int t = 0; t < NH; ++t) {
        float* st = s + t * n;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = first_lanes(n - j);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, st + j));
        }
        const __m512 tv = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = first_lanes(n - j);
            const __m512 p = _mm512_maskz_mov_ps(mask, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, st + j), tv)));
            _mm512_mask_storeu_ps(st + j, mask, p);
            sum = _mm512_add_ps(sum, p);
        }
        total[t] = _mm512_reduce_add_ps(sum);
    }
    // W chunks of the head's dimension a pass over the values (W * NH accumulators in registers): each value widened
    // once for the heads, each weight broadcast once for the W chunks
    constexpr int W = NH <= 6 ? 4 : 2;
    for (int64_t c = 0; c < chunks; c += W) {
        const int w = chunks - c < W ? int(chunks - c) : W;
        __m512 acc[NH][W];
        for (int t = 0; t < NH; ++t)
            for (int u = 0; u < W; ++u) acc[t][u] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const uint16_t* vr = vh + j * D + 16 * c;
            __m512 vv[W];
            for (int u = 0; u < W; ++u)
                vv[u] = bf2f_ps(_mm256_maskz_loadu_epi16(u < w ? __mmask16(0xFFFF) : __mmask16(0), vr + 16 * u));
            for (int t = 0; t < NH; ++t) {
                const __m512 p = _mm512_set1_ps(s[t * n + j]);
                for (int u = 0; u < W; ++u) acc[t][u] = _mm512_fmadd_ps(p, vv[u], acc[t][u]);
            }
        }
        for (int t = 0; t < NH; ++t) {
            const __m512 tv = _mm512_set1_ps(total[t]);
            for (int u = 0; u < w; ++u) _mm512_storeu_ps(o + t * D + 16 * (c + u), _mm512_div_ps(acc[t][u], tv));
        }
    }
}

extern "C" void pacer_exact_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t H,
                                      int64_t KV, int64_t M, int64_t L, int64_t D, int64_t kv_stride,
                                      const int64_t* lo, const int64_t* hi, float scaling, float* out) {
    const int64_t groups = H / KV;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * M * KV; ++task) {
        const int64_t b = task / (M * KV), i = (task / KV) % M, g = task % KV;
        const int64_t first = lo[b * M + i], last = hi[b * M + i];
        float* o = out + ((b * M + i) * H + g * groups) * D;  // the group's query heads are consecutive
        if (last <= first) {
            for (int64_t t = 0; t < groups * D; ++t) o[t] = 0.0f;
            continue;
        }
        const int64_t n = last - first;
        const uint16_t* kh = k + (b * KV + g) * kv_stride + first * D;
        const uint16_t* vh = v + (b * KV + g) * kv_stride + first * D;
        static thread_local std::vector<float> scratch;
        const int64_t batch = groups < 8 ? groups : 8;
        if ((int64_t)scratch.size() < batch * (n + D)) scratch.resize(batch * (n + D));
        float* qf = scratch.data();
        float* s = qf + batch * D;
        for (int64_t h0 = 0; h0 < groups; h0 += 8) {
            const int64_t nh = groups - h0 < 8 ? groups - h0 : 8;
            const uint16_t* qr[8];
            for (int64_t t = 0; t < nh; ++t) {
                qr[t] = q + ((b * H + g * groups + h0 + t) * M + i) * D;
#ifndef __AVX512BF16__  // the scores' fused multiply-adds read the query widened (vdpbf16ps reads its bf16)
                for (int64_t c = 0; c < D; c += 16)
                    _mm512_storeu_ps(qf + t * D + c, bf2f_ps(_mm256_loadu_si256((const __m256i*)(qr[t] + c))));
#endif
            }
            float* oh = o + h0 * D;
            switch (nh) {
                case 1: attend_heads<1>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 2: attend_heads<2>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 3: attend_heads<3>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 4: attend_heads<4>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 5: attend_heads<5>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 6: attend_heads<6>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                case 7: attend_heads<7>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
                default: attend_heads<8>(qr, qf, kh, vh, n, D, scaling, s, oh); break;
            }
        }
    }
}

// calls of this many rows or more (a prompt) split their row-wise loops over threads: each row (each element) is
// still computed by the same code alone; fewer rows (a decoding step) stay on one thread, cheaper than waking others
static const int64_t PARALLEL_ROWS = 8;

// transformers' RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps)), x in float
static void rms_norm(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out) {
    float squares = 0.0f;
    for (int64_t i = 0; i < n; ++i) squares += bf2f(x[i]) * bf2f(x[i]);
    const float r = 1.0f / std::sqrt(squares / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = f2bf(bf2f(w[i]) * round_bf(bf2f(x[i]) * r));
}

// x * cos + rotate_half(x) * sin per head, each product and the sum rounded to bf16 (apply_rotary_pos_emb)
static void rotary(uint16_t* x, int64_t heads, int64_t d, const uint16_t* cos, const uint16_t* sin) {
    const int64_t half = d / 2;
    float out[512];
    for (int64_t h = 0; h < heads; ++h) {
        uint16_t* r = x + h * d;
        for (int64_t j = 0; j < d; ++j) {
            const float rot = j < half ? -bf2f(r[j + half]) : bf2f(r[j - half]);
            out[j] = round_bf(bf2f(r[j]) * bf2f(cos[j])) + round_bf(rot * bf2f(sin[j]));
        }
        for (int64_t j = 0; j < d; ++j) r[j] = f2bf(out[j]);
    }
}

// One linear layer as the fused layers read it, n outputs, a float bias or null:
//   kind 0, an Int4Linear(kernel="pacer"): packed, a = scales and zeros (bf16 bits)        pacer_i4_matmul
//   kind 1, a W4A8Linear (Q4_K):           packed, a = sc, mn, dd                           pacer_q4k_matmul
//   kind 2, a W8A8Linear (int8):           packed, a = one float scale per output           pacer_q8_matmul
enum { KIND_INT4 = 0, KIND_Q4K = 1, KIND_Q8 = 2 };
struct Weight {
    int64_t kind;
    const uint8_t* packed;
    const void* a;
    const uint8_t* mn;
    const uint16_t* dd;
    const float* bias;
    int64_t n;
};

// bf16 rows quantized as the kernels read them (pacer_quantize_rows, blocks of `block`)
struct QuantRows {
    int64_t m, k;
    int8_t* xq;
    float* sx;
    int16_t* xs;
    QuantRows(const uint16_t* x, int64_t m, int64_t k, int64_t block)
        : m(m), k(k), xq(new int8_t[m * k]), sx(new float[m * k / 32]), xs(new int16_t[m * k / 32]) {
        pacer_quantize_rows(x, m, k, block, xq, sx, xs);
    }
    ~QuantRows() { delete[] xq; delete[] sx; delete[] xs; }
};

// a call's input rows, quantized once per block size its layers read (q, k and v read one input; so do gate and up)
struct Inputs {
    const uint16_t* x;
    int64_t m, k;
    QuantRows* by32 = nullptr;
    QuantRows* by256 = nullptr;
    Inputs(const uint16_t* x, int64_t m, int64_t k) : x(x), m(m), k(k) {}
    ~Inputs() { delete by32; delete by256; }
    const QuantRows& rows(int64_t block) {
        QuantRows*& q = block == 256 ? by256 : by32;
        if (!q) q = new QuantRows(x, m, k, block);
        return *q;
    }
};

static void linear_rows(const Weight& w, Inputs& in, uint16_t* out) {
    if (w.kind == KIND_Q4K) {
        const QuantRows& x = in.rows(256);
        pacer_q4k_matmul(w.packed, static_cast<const uint8_t*>(w.a), w.mn, w.dd, w.n, x.k, x.xq, x.sx, x.xs, x.m,
                         w.bias, 1, out);
    } else if (w.kind == KIND_Q8) {
        const QuantRows& x = in.rows(32);
        pacer_q8_matmul(w.packed, static_cast<const float*>(w.a), w.n, x.k, x.xq, x.sx, x.xs, x.m, w.bias, 1, out);
    } else {
        const QuantRows& x = in.rows(32);
        pacer_i4_matmul(w.packed, static_cast<const uint16_t*>(w.a), w.n, x.k, x.xq, x.sx, x.xs, x.m, w.bias, 1, out);
    }
}

// (m, heads, d) rows -> (heads, m, d), as transformers' attention and cache hold them: head h's rows from
// out + h * stride (stride m * d for a tensor of these rows alone), row r at its row `at + r`, or at slots[r] where
// `slots` is given (the rows of several sequences packed into one call, each written at its own sequence's position)
static void heads_first(const uint16_t* x, int64_t m, int64_t heads, int64_t d, int64_t stride, int64_t at,
                        const int64_t* slots, uint16_t* out) {
    for (int64_t r = 0; r < m; ++r) {
        const int64_t row = slots ? slots[r] : at + r;
        for (int64_t h = 0; h < heads; ++h) std::memcpy(out + h * stride + row * d, x + (r * heads + h) * d, d * 2);
    }
}

// ws: q, k, v projections. h (m, hidden) -> q (heads, m, d), k and v rotated (cos, sin: (m, d)), bf16. k and v go to
// rows at .. at + m - 1 of each head's `kv_stride` elements (at 0 and m * d: tensors (kv_heads, m, d) of their own;
// a cache's buffers (kv_heads, capacity, d): capacity * d, `at` the positions it holds), written in place; with
// `slots` (m positions, or null), row r's to slots[r] instead.
extern "C" void pacer_layer_qkv(const uint16_t* h, int64_t m, int64_t hidden, const uint16_t* norm, float eps,
                                const Weight* ws, const uint16_t* cos, const uint16_t* sin, int64_t d, uint16_t* q,
                                uint16_t* k, uint16_t* v, int64_t kv_stride, int64_t at, const int64_t* slots) {
    uint16_t* x = new uint16_t[m * hidden];
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; ++r) rms_norm(h + r * hidden, norm, hidden, eps, x + r * hidden);
    Inputs normed(x, m, hidden);
    uint16_t* outs[3] = {q, k, v};
    for (int i = 0; i < 3; ++i) {
        const int64_t n = ws[i].n;
        uint16_t* rows = new uint16_t[m * n];
        linear_rows(ws[i], normed, rows);
        if (i < 2) {
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
            for (int64_t r = 0; r < m; ++r) rotary(rows + r * n, n / d, d, cos + r * d, sin + r * d);
        }
        if (i == 0) heads_first(rows, m, n / d, d, m * d, 0, nullptr, outs[i]);
        else heads_first(rows, m, n / d, d, kv_stride, at, slots, outs[i]);
        delete[] rows;
    }
    delete[] x;
}

// ws: o, gate, up, down projections. q (heads, m, d), the m new tokens' queries, against the cached keys and values
// (kv_heads, length, d, heads `kv_stride` elements apart; the new tokens last): row r sees keys 0 .. length - m + r,
// or keys_lo[r] .. keys_hi[r] - 1 where they are given (m bounds each: the rows of several sequences packed into one
// call, each seeing its own sequence's keys). Then o_proj, the residual, the MLP and its residual: h (m, hidden) ->
// out (m, hidden), bf16.
extern "C" void pacer_layer_rest(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t m,
                                 int64_t heads, int64_t kv_heads, int64_t length, int64_t d, int64_t kv_stride,
                                 float scaling,
                                 const uint16_t* h, int64_t hidden, const uint16_t* norm, float eps, const Weight* ws,
                                 int64_t inter, const int64_t* keys_lo, const int64_t* keys_hi, uint16_t* out) {
    float* attn = new float[m * heads * d];
    int64_t* lo = new int64_t[m];
    int64_t* hi = new int64_t[m];
    for (int64_t r = 0; r < m; ++r) {
        lo[r] = keys_lo ? keys_lo[r] : 0;
        hi[r] = keys_hi ? keys_hi[r] : length - m + r + 1;
    }
    pacer_exact_attention(q, keys, values, 1, heads, kv_heads, m, length, d, kv_stride, lo, hi, scaling, attn);
    const int64_t wide = heads * d > inter ? heads * d : inter;
    uint16_t* a = new uint16_t[m * wide];
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t i = 0; i < m * heads * d; ++i) a[i] = f2bf(attn[i]);
    uint16_t* o = new uint16_t[m * hidden];
    {
        Inputs attended(a, m, heads * d);
        linear_rows(ws[0], attended, o);
    }
    uint16_t* mid = new uint16_t[m * hidden];
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t i = 0; i < m * hidden; ++i) mid[i] = f2bf(bf2f(h[i]) + bf2f(o[i]));
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; ++r) rms_norm(mid + r * hidden, norm, hidden, eps, o + r * hidden);
    uint16_t* gate = new uint16_t[m * inter];
    uint16_t* up = new uint16_t[m * inter];
    {
        Inputs normed(o, m, hidden);
        linear_rows(ws[1], normed, gate);
        linear_rows(ws[2], normed, up);
    }
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; ++r) silu_mul(gate + r * inter, up + r * inter, inter, a + r * inter);
    {
        Inputs activated(a, m, inter);
        linear_rows(ws[3], activated, o);
    }
#pragma omp parallel for schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t i = 0; i < m * hidden; ++i) out[i] = f2bf(bf2f(mid[i]) + bf2f(o[i]));
    delete[] attn;
    delete[] lo;
    delete[] hi;
    delete[] a;
    delete[] o;
    delete[] mid;
    delete[] gate;
    delete[] up;
}

// A decoder's layers one after another over one sequence's cache, the new keys and values written in place:
// for each layer l, its two calls above (norms[2l], eps[2l] before attention; norms[2l + 1], eps[2l + 1] after;
// ws[7l .. 7l + 6]: q, k, v, o, gate, up, down), keys[l] / values[l] its cache buffers (kv_heads, capacity, d)
// holding held[l] positions. h (m, hidden) -> out (m, hidden), bf16: the bits the calls layer by layer give. With
// `slots`, `keys_lo` and `keys_hi` (m each, or null), every layer writes row r's key and value at slots[r] and row r
// attends to keys_lo[r] .. keys_hi[r] - 1 (held then unused): a call of several sequences' rows packed together.
extern "C" void pacer_decoder_layers(const uint16_t* h, int64_t m, int64_t hidden, int64_t layers,
                                     const uint16_t* const* norms, const float* eps, const Weight* ws,
                                     const uint16_t* cos, const uint16_t* sin, int64_t d, float scaling,
                                     uint16_t* const* keys, uint16_t* const* values, const int64_t* capacity,
                                     const int64_t* held, const int64_t* slots, const int64_t* keys_lo,
                                     const int64_t* keys_hi, uint16_t* out) {
    uint16_t* x = new uint16_t[m * hidden];
    std::memcpy(x, h, m * hidden * 2);
    for (int64_t l = 0; l < layers; ++l) {
        const Weight* w = ws + 7 * l;
        const int64_t heads = w[0].n / d, kv_heads = w[1].n / d;
        uint16_t* q = new uint16_t[m * heads * d];
        pacer_layer_qkv(x, m, hidden, norms[2 * l], eps[2 * l], w, cos, sin, d, q, keys[l], values[l],
                        capacity[l] * d, held[l], slots);
        pacer_layer_rest(q, keys[l], values[l], m, heads, kv_heads, slots ? capacity[l] : held[l] + m, d,
                         capacity[l] * d, scaling, x, hidden, norms[2 * l + 1], eps[2 * l + 1], w + 3, w[4].n, keys_lo,
                         keys_hi, l + 1 == layers ? out : x);
        delete[] q;
    }
    delete[] x;
}

// The instruction's own bound, for measurements (pacer-bench kernel-rows): `iterations` x 12 vpdpbusd on the calling
// thread, 12 independent accumulators (more than the instruction's latency times its throughput on current cores),
// written in assembly so that no compiler can fold them. Returns the multiply-adds done (64 an instruction); the
// caller times the call. Every kernel above does at least one vpdpbusd per 64 multiply-adds, so no call of theirs can
// run faster than this loop.
extern "C" int64_t pacer_vnni_peak(int64_t iterations) {
    int64_t n = iterations;
    if (n <= 0) return 0;
    __asm__ volatile(
        "vpternlogd $0xff, %%zmm14, %%zmm14, %%zmm14\n\t"
        "vpternlogd $0xff, %%zmm15, %%zmm15, %%zmm15\n\t"
        "1:\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm0\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm1\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm2\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm3\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm4\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm5\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm6\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm7\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm8\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm9\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm10\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm11\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(n)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm14",
          "xmm15", "cc");
    return iterations * 12 * 64;
}
#else
extern "C" int pacer_vnni_available() { return 0; }
extern "C" int pacer_amx_available() { return 0; }
extern "C" int pacer_bf16_tiles_available() { return 0; }
extern "C" int64_t pacer_set_amx_rows(int64_t) { return 0; }
extern "C" int64_t pacer_vnni_peak(int64_t) { return 0; }
#endif
