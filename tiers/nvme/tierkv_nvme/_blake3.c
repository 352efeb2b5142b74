/* Keyed BLAKE3, 32-byte digests (see _blake3.h for why it is here).
 *
 * BLAKE3 in brief: the input is cut into 1 KiB chunks; each chunk is compressed block
 * by block (64 bytes) into an 8-word chaining value; chaining values are merged
 * pairwise into parent nodes up a binary tree whose left subtrees are always full
 * (the largest power of two of chunks); the root's compression, flagged ROOT, gives
 * the digest. Keyed mode starts every chunk and parent from the key's words instead of
 * the IV and flags every compression KEYED_HASH.
 *
 * The whole input is known up front (a frame's header and payload), so every chunk but
 * the last is a full, non-root chunk: those are hashed in groups of up to 128 (sixteen
 * at once with AVX-512, eight with AVX2, each vector lane a chunk; the CPU is asked at
 * run time), then the group's parent nodes a tree level at a time, as many side by
 * side, and the group's subtrees pushed on the subtree stack; the last chunk then
 * closes the tree. A chunk that straddles two parts (the frame header
 * and the payload's first region, or two regions) is copied into a stack buffer. */
#include "_blake3.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TKV_HAVE_AVX2_PATH 1
#endif

#define CHUNK_BYTES 1024
#define BLOCK_BYTES 64
#define MAX_DEPTH 54 /* subtrees of 2^64 bytes of 1 KiB chunks */
#define GROUP 128    /* chunks hashed before their parents are: 8 side-by-side passes of 16 */
#define MAX_RUNS 8   /* a group's power-of-two runs: 128, 64, ..., 1 */

enum {
    CHUNK_START = 1 << 0,
    CHUNK_END = 1 << 1,
    PARENT = 1 << 2,
    ROOT = 1 << 3,
    KEYED_HASH = 1 << 4,
};

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

/* The message word order of round r: the permutation below applied r times. */
static const uint8_t SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

/* The seven rounds of a compression over state `v` and message words `m`, with `MIX`
 * (the G function) of whichever width: columns, then diagonals, each round's words
 * in SCHEDULE's order. One definition for the portable, AVX2 and AVX-512 paths. */
#define ROUNDS(MIX, v, m)                                                                  \
    _Pragma("GCC unroll 7") for (int r = 0; r < 7; r++) {                                  \
        const uint8_t *s = SCHEDULE[r];                                                    \
        MIX(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);                                             \
        MIX(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);                                             \
        MIX(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);                                            \
        MIX(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);                                            \
        MIX(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);                                            \
        MIX(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);                                          \
        MIX(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);                                           \
        MIX(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);                                           \
    }

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void store32(uint8_t *p, uint32_t w) {
    p[0] = (uint8_t)w;
    p[1] = (uint8_t)(w >> 8);
    p[2] = (uint8_t)(w >> 16);
    p[3] = (uint8_t)(w >> 24);
}

static inline uint32_t rotr(uint32_t w, int c) { return (w >> c) | (w << (32 - c)); }

/* -- the portable compression ----------------------------------------------------- */

static inline void mix(uint32_t *v, int a, int b, int c, int d, uint32_t x, uint32_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 12);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 8);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 7);
}

/* cv <- the first 8 words of compress(cv, block, counter, len, flags). */
static void compress(uint32_t cv[8], const uint8_t block[BLOCK_BYTES], uint64_t counter,
                     uint32_t len, uint32_t flags) {
    uint32_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = load32(block + 4 * i);
    memcpy(v, cv, 8 * sizeof *v);
    memcpy(v + 8, IV, 4 * sizeof *v);
    v[12] = (uint32_t)counter;
    v[13] = (uint32_t)(counter >> 32);
    v[14] = len;
    v[15] = flags;
    ROUNDS(mix, v, m);
    for (int i = 0; i < 8; i++)
        cv[i] = v[i] ^ v[i + 8];
}

/* A node not yet compressed for the last time: whether it is the root decides its flags. */
typedef struct {
    uint32_t cv[8];
    uint8_t block[BLOCK_BYTES];
    uint32_t len, flags;
    uint64_t counter;
} Node;

static void node_cv(const Node *node, uint32_t out[8]) {
    memcpy(out, node->cv, sizeof node->cv);
    compress(out, node->block, node->counter, node->len, node->flags);
}

/* The chunk `counter` of `len` bytes (at most CHUNK_BYTES; 0 only for an empty input):
 * every block compressed but the last, which the Node keeps. */
static Node chunk_node(const uint8_t *data, size_t len, const uint32_t key[8], uint64_t counter) {
    Node node;
    memcpy(node.cv, key, sizeof node.cv);
    size_t blocks = len ? (len + BLOCK_BYTES - 1) / BLOCK_BYTES : 1;
    for (size_t b = 0; b + 1 < blocks; b++)
        compress(node.cv, data + b * BLOCK_BYTES, counter, BLOCK_BYTES,
                 KEYED_HASH | (b == 0 ? CHUNK_START : 0));
    size_t last = len - (blocks - 1) * BLOCK_BYTES;
    memset(node.block, 0, sizeof node.block);
    memcpy(node.block, data + (blocks - 1) * BLOCK_BYTES, last);
    node.len = (uint32_t)last;
    node.counter = counter;
    node.flags = KEYED_HASH | CHUNK_END | (blocks == 1 ? CHUNK_START : 0);
    return node;
}

static Node parent_node(const uint32_t left[8], const uint32_t right[8], const uint32_t key[8]) {
    Node node;
    memcpy(node.cv, key, sizeof node.cv);
    for (int i = 0; i < 8; i++) {
        store32(node.block + 4 * i, left[i]);
        store32(node.block + 32 + 4 * i, right[i]);
    }
    node.len = BLOCK_BYTES;
    node.counter = 0;
    node.flags = KEYED_HASH | PARENT;
    return node;
}


/* -- eight chunks at once (AVX2): lane l of each vector is chunk l's word ---------- */
#ifdef TKV_HAVE_AVX2_PATH
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
AVX2 static inline __m256i xor(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
AVX2 static inline __m256i rot16(__m256i x) {
    return _mm256_shuffle_epi8(x, _mm256_set_epi8(13, 12, 15, 14, 9, 8, 11, 10, 5, 4, 7, 6, 1,
                                                  0, 3, 2, 13, 12, 15, 14, 9, 8, 11, 10, 5, 4,
                                                  7, 6, 1, 0, 3, 2));
}
AVX2 static inline __m256i rot8(__m256i x) {
    return _mm256_shuffle_epi8(x, _mm256_set_epi8(12, 15, 14, 13, 8, 11, 10, 9, 4, 7, 6, 5, 0,
                                                  3, 2, 1, 12, 15, 14, 13, 8, 11, 10, 9, 4, 7,
                                                  6, 5, 0, 3, 2, 1));
}
AVX2 static inline __m256i rot12(__m256i x) {
    return _mm256_or_si256(_mm256_srli_epi32(x, 12), _mm256_slli_epi32(x, 20));
}
AVX2 static inline __m256i rot7(__m256i x) {
    return _mm256_or_si256(_mm256_srli_epi32(x, 7), _mm256_slli_epi32(x, 25));
}

AVX2 static inline void mix8(__m256i *v, int a, int b, int c, int d, __m256i x, __m256i y) {
    v[a] = add(add(v[a], v[b]), x);
    v[d] = rot16(xor(v[d], v[a]));
    v[c] = add(v[c], v[d]);
    v[b] = rot12(xor(v[b], v[c]));
    v[a] = add(add(v[a], v[b]), y);
    v[d] = rot8(xor(v[d], v[a]));
    v[c] = add(v[c], v[d]);
    v[b] = rot7(xor(v[b], v[c]));
}

/* rows[0..7] (8 words each) -> rows[i] holds word i of every former row. */
AVX2 static inline void transpose8(__m256i *rows) {
    __m256i t0 = _mm256_unpacklo_epi32(rows[0], rows[1]);
    __m256i t1 = _mm256_unpackhi_epi32(rows[0], rows[1]);
    __m256i t2 = _mm256_unpacklo_epi32(rows[2], rows[3]);
    __m256i t3 = _mm256_unpackhi_epi32(rows[2], rows[3]);
    __m256i t4 = _mm256_unpacklo_epi32(rows[4], rows[5]);
    __m256i t5 = _mm256_unpackhi_epi32(rows[4], rows[5]);
    __m256i t6 = _mm256_unpacklo_epi32(rows[6], rows[7]);
    __m256i t7 = _mm256_unpackhi_epi32(rows[6], rows[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2); /* word 0 of rows 0-3 | word 4 */
    __m256i u1 = _mm256_unpackhi_epi64(t0, t2); /* word 1 | word 5 */
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3); /* word 2 | word 6 */
    __m256i u3 = _mm256_unpackhi_epi64(t1, t3); /* word 3 | word 7 */
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6);
    __m256i u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7);
    __m256i u7 = _mm256_unpackhi_epi64(t5, t7);
    rows[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    rows[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    rows[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    rows[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    rows[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    rows[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    rows[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    rows[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* Eight inputs of `blocks` 64-byte blocks each (chunks: 16, parents: 1), lane l counted
 * counter + l (chunks) or counter (parents, `step` 0), every block flagged `flags`, the
 * first also `first`, the last also `last`: each input's chaining value into out[l]. */
AVX2 static void hash8_avx2(const uint8_t *const *chunks, int blocks, const uint32_t key[8],
                            uint64_t counter, int step, uint32_t flags, uint32_t first,
                            uint32_t last, uint32_t (*out)[8]) {
    __m256i h[8];
    #pragma GCC unroll 16
    for (int i = 0; i < 8; i++)
        h[i] = _mm256_set1_epi32((int)key[i]);
    uint32_t lo[8], hi[8];
    #pragma GCC unroll 16
    for (int l = 0; l < 8; l++) {
        lo[l] = (uint32_t)(counter + (uint64_t)(l * step));
        hi[l] = (uint32_t)((counter + (uint64_t)(l * step)) >> 32);
    }
    const __m256i counter_lo = _mm256_loadu_si256((const __m256i *)lo);
    const __m256i counter_hi = _mm256_loadu_si256((const __m256i *)hi);
    for (int b = 0; b < blocks; b++) {
        __m256i m[16];
        #pragma GCC unroll 16
        for (int l = 0; l < 8; l++) { /* little-endian words, as load32 reads them */
            m[l] = _mm256_loadu_si256((const __m256i *)(chunks[l] + b * BLOCK_BYTES));
            m[8 + l] = _mm256_loadu_si256((const __m256i *)(chunks[l] + b * BLOCK_BYTES + 32));
        }
        transpose8(m);
        transpose8(m + 8);
        uint32_t block_flags = flags | (b == 0 ? first : 0) | (b == blocks - 1 ? last : 0);
        __m256i v[16] = {
            h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7],
            _mm256_set1_epi32((int)IV[0]), _mm256_set1_epi32((int)IV[1]),
            _mm256_set1_epi32((int)IV[2]), _mm256_set1_epi32((int)IV[3]),
            counter_lo, counter_hi, _mm256_set1_epi32(BLOCK_BYTES),
            _mm256_set1_epi32((int)block_flags),
        };
        ROUNDS(mix8, v, m);
        #pragma GCC unroll 16
        for (int i = 0; i < 8; i++)
            h[i] = xor(v[i], v[i + 8]);
    }
    transpose8(h); /* h[l]: lane l's chaining value */
    #pragma GCC unroll 16
    for (int l = 0; l < 8; l++)
        _mm256_storeu_si256((__m256i *)out[l], h[l]);
}

/* -- sixteen chunks at once (AVX-512): the same, twice as wide, one-op rotations ---- */
#define AVX512 __attribute__((target("avx512f")))

AVX512 static inline void mix16(__m512i *v, int a, int b, int c, int d, __m512i x, __m512i y) {
    v[a] = _mm512_add_epi32(_mm512_add_epi32(v[a], v[b]), x);
    v[d] = _mm512_ror_epi32(_mm512_xor_si512(v[d], v[a]), 16);
    v[c] = _mm512_add_epi32(v[c], v[d]);
    v[b] = _mm512_ror_epi32(_mm512_xor_si512(v[b], v[c]), 12);
    v[a] = _mm512_add_epi32(_mm512_add_epi32(v[a], v[b]), y);
    v[d] = _mm512_ror_epi32(_mm512_xor_si512(v[d], v[a]), 8);
    v[c] = _mm512_add_epi32(v[c], v[d]);
    v[b] = _mm512_ror_epi32(_mm512_xor_si512(v[b], v[c]), 7);
}

/* rows[0..15] (16 words each) -> rows[i] holds word i of every former row: 32-bit and
 * 64-bit interleaves within each 128-bit lane, then a 4x4 transpose of the lanes. */
AVX512 static inline void transpose16(__m512i *rows) {
    __m512i t[16], u[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    #pragma GCC unroll 16
    for (int j = 0; j < 4; j++) { /* u[4j + w], lane k: word 4k + w of rows 4j .. 4j + 3 */
        u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
        u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
    #pragma GCC unroll 16
    for (int w = 0; w < 4; w++) {
        __m512i ab_lo = _mm512_shuffle_i32x4(u[w], u[4 + w], 0x44);
        __m512i ab_hi = _mm512_shuffle_i32x4(u[w], u[4 + w], 0xEE);
        __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0x44);
        __m512i cd_hi = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0xEE);
        rows[w] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
        rows[4 + w] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
        rows[8 + w] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
        rows[12 + w] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
    }
}

/* hash8_avx2 with sixteen inputs. */
AVX512 static void hash16_avx512(const uint8_t *const *chunks, int blocks, const uint32_t key[8],
                                 uint64_t counter, int step, uint32_t flags, uint32_t first,
                                 uint32_t last, uint32_t (*out)[8]) {
    __m512i h[8];
    #pragma GCC unroll 16
    for (int i = 0; i < 8; i++)
        h[i] = _mm512_set1_epi32((int)key[i]);
    uint32_t lo[16], hi[16];
    #pragma GCC unroll 16
    for (int l = 0; l < 16; l++) {
        lo[l] = (uint32_t)(counter + (uint64_t)(l * step));
        hi[l] = (uint32_t)((counter + (uint64_t)(l * step)) >> 32);
    }
    const __m512i counter_lo = _mm512_loadu_si512(lo);
    const __m512i counter_hi = _mm512_loadu_si512(hi);
    for (int b = 0; b < blocks; b++) {
        __m512i m[16];
        #pragma GCC unroll 16
        for (int l = 0; l < 16; l++)
            m[l] = _mm512_loadu_si512(chunks[l] + b * BLOCK_BYTES);
        transpose16(m);
        uint32_t block_flags = flags | (b == 0 ? first : 0) | (b == blocks - 1 ? last : 0);
        __m512i v[16] = {
            h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7],
            _mm512_set1_epi32((int)IV[0]), _mm512_set1_epi32((int)IV[1]),
            _mm512_set1_epi32((int)IV[2]), _mm512_set1_epi32((int)IV[3]),
            counter_lo, counter_hi, _mm512_set1_epi32(BLOCK_BYTES),
            _mm512_set1_epi32((int)block_flags),
        };
        ROUNDS(mix16, v, m);
        #pragma GCC unroll 16
        for (int i = 0; i < 8; i++)
            h[i] = _mm512_xor_si512(v[i], v[i + 8]);
    }
    uint32_t words[8][16];
    #pragma GCC unroll 16
    for (int i = 0; i < 8; i++)
        _mm512_storeu_si512(words[i], h[i]);
    #pragma GCC unroll 16
    for (int l = 0; l < 16; l++)
        #pragma GCC unroll 16
        for (int i = 0; i < 8; i++)
            out[l][i] = words[i][l];
}

/* Chunks this CPU hashes at once: 16 with AVX-512, 8 with AVX2, else 1. */
static int simd_lanes(void) {
    static int known = 0;
    if (known == 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 16 : __builtin_cpu_supports("avx2") ? 8 : 1;
    }
    return known;
}
#else
static int simd_lanes(void) { return 1; }
#endif

int tkv_blake3_lanes(void) { return simd_lanes(); }

/* `count` inputs (at most `lanes`) of `blocks` blocks at once: hash_many of the
 * reference design. Idle lanes hash a copy of input 0. `lanes` > 1 only on x86-64. */
static void hash_many(const uint8_t **inputs, int count, int lanes, int blocks,
                      const uint32_t key[8], uint64_t counter, int step, uint32_t flags,
                      uint32_t first, uint32_t last, uint32_t (*out)[8]) {
#ifdef TKV_HAVE_AVX2_PATH
    if (lanes > 1 && count > 1) {
        for (int g = count; g < lanes; g++)
            inputs[g] = inputs[0];
        if (lanes == 16)
            hash16_avx512(inputs, blocks, key, counter, step, flags, first, last, out);
        else
            hash8_avx2(inputs, blocks, key, counter, step, flags, first, last, out);
        return;
    }
#endif
    for (int c = 0; c < count; c++) {
        memcpy(out[c], key, 8 * sizeof *key);
        for (int b = 0; b < blocks; b++)
            compress(out[c], inputs[c] + b * BLOCK_BYTES, counter + (uint64_t)(c * step),
                     BLOCK_BYTES, flags | (b == 0 ? first : 0) | (b == blocks - 1 ? last : 0));
    }
}

/* The `count` (at most GROUP) chaining values of a group of chunks (`cvs`,
 * overwritten) as whole subtrees: the group splits into runs of a power of two chunks,
 * largest first (15: 8, 4, 2, 1), and every run's parents are made a level at a time,
 * all runs' parents of a level side by side, `lanes` at once. sizes[r]: run r's
 * chunks, its chaining value in cvs[r]; returns the number of runs. */
static int subtrees(uint32_t (*cvs)[8], int count, int lanes, const uint32_t key[8],
                    int sizes[MAX_RUNS]) {
    int runs = 0, starts[MAX_RUNS];
    for (int size = GROUP, at = 0; size >= 1; size /= 2)
        if (count & size) {
            starts[runs] = at;
            sizes[runs++] = size;
            at += size;
        }
    for (int width = 1; width < sizes[0]; width *= 2) { /* each run now `width` times fewer */
        const uint8_t *pairs[GROUP / 2]; /* cvs[i], cvs[i + 1]: one parent's 64-byte block */
        int to[GROUP / 2], n = 0;
        for (int r = 0; r < runs; r++)
            for (int i = 0; i < sizes[r] / (2 * width); i++) {
                pairs[n] = (const uint8_t *)cvs[starts[r] + 2 * i];
                to[n++] = starts[r] + i;
            }
        uint32_t parents[GROUP / 2][8];
        for (int at = 0; at < n; at += lanes) {
            const uint8_t *some[16];
            int k = n - at < lanes ? n - at : lanes;
            memcpy(some, pairs + at, sizeof *some * (size_t)k);
            hash_many(some, k, lanes, 1, key, 0, 0, KEYED_HASH | PARENT, 0, 0, parents + at);
        }
        for (int p = 0; p < n; p++) /* to[p] <= p: in place, in order */
            memcpy(cvs[to[p]], parents[p], sizeof parents[p]);
    }
    for (int r = 0; r < runs; r++)
        memcpy(cvs[r], cvs[starts[r]], sizeof cvs[r]);
    return runs;
}

/* -- the input: parts read in order, a chunk at a time ------------------------------ */

typedef struct {
    const struct iovec *parts;
    int n, at;
    size_t off;
} Cursor;

/* The next `len` bytes: a pointer into their part when they lie in one, else copied
 * into `spare` (the caller never asks past the end). */
static const uint8_t *take(Cursor *c, size_t len, uint8_t *spare) {
    while (c->at < c->n && c->off == c->parts[c->at].iov_len) {
        c->at++;
        c->off = 0;
    }
    if (len == 0 || (c->at < c->n && c->parts[c->at].iov_len - c->off >= len)) {
        const uint8_t *p = len ? (const uint8_t *)c->parts[c->at].iov_base + c->off : spare;
        c->off += len;
        return p;
    }
    for (size_t got = 0; got < len;) {
        while (c->off == c->parts[c->at].iov_len) {
            c->at++;
            c->off = 0;
        }
        size_t step = c->parts[c->at].iov_len - c->off;
        if (step > len - got)
            step = len - got;
        memcpy(spare + got, (const uint8_t *)c->parts[c->at].iov_base + c->off, step);
        got += step;
        c->off += step;
    }
    return spare;
}

void tkv_blake3_keyed_lanes(const uint8_t key_bytes[TKV_BLAKE3_KEY_BYTES],
                            const struct iovec *parts, int n, uint8_t out[TKV_BLAKE3_OUT_BYTES],
                            int lanes) {
    if (lanes != 1 && lanes != 8 && lanes != 16)
        lanes = 1;
    if (lanes > simd_lanes())
        lanes = simd_lanes();
    uint32_t key[8];
    for (int i = 0; i < 8; i++)
        key[i] = load32(key_bytes + 4 * i);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += parts[i].iov_len;
    uint64_t chunks = total ? (total + CHUNK_BYTES - 1) / CHUNK_BYTES : 1;
    Cursor cursor = {parts, n, 0, 0};
    uint8_t spare[16][CHUNK_BYTES];
    uint32_t stack[MAX_DEPTH][8];
    int depth = 0;
    uint64_t chunk = 0;
    /* every chunk but the last: full, not the root */
    while (chunk + 1 < chunks) {
        uint64_t left = chunks - 1 - chunk;
        int group = left >= GROUP ? GROUP : (int)left;
        uint32_t cvs[GROUP][8];
        for (int at = 0; at < group; at += lanes) {
            const uint8_t *data[16];
            int k = group - at < lanes ? group - at : lanes;
            for (int g = 0; g < k; g++)
                data[g] = take(&cursor, CHUNK_BYTES, spare[g]);
            hash_many(data, k, lanes, CHUNK_BYTES / BLOCK_BYTES, key, chunk + (uint64_t)at, 1,
                      KEYED_HASH, CHUNK_START, CHUNK_END, cvs + at);
        }
        int sizes[MAX_RUNS];
        int runs = subtrees(cvs, group, lanes, key, sizes);
        for (int r = 0; r < runs; r++) {
            /* push the run's subtree, first merging every completed subtree it closes: as
             * many as the trailing zero bits of the chunks so far, counted in runs of its size */
            uint32_t cv[8];
            memcpy(cv, cvs[r], sizeof cv);
            chunk += (uint64_t)sizes[r];
            for (uint64_t done = chunk / (uint64_t)sizes[r]; (done & 1) == 0; done >>= 1) {
                Node parent = parent_node(stack[--depth], cv, key);
                node_cv(&parent, cv);
            }
            memcpy(stack[depth++], cv, sizeof cv);
        }
    }
    size_t last = total - (size_t)(chunk * CHUNK_BYTES);
    Node node = chunk_node(take(&cursor, last, spare[0]), last, key, chunk);
    while (depth > 0) {
        uint32_t cv[8];
        node_cv(&node, cv);
        node = parent_node(stack[--depth], cv, key);
    }
    uint32_t root[8];
    memcpy(root, node.cv, sizeof root);
    compress(root, node.block, 0, node.len, node.flags | ROOT);
    for (int i = 0; i < 8; i++)
        store32(out + 4 * i, root[i]);
}

void tkv_blake3_keyed(const uint8_t key[TKV_BLAKE3_KEY_BYTES], const struct iovec *parts, int n,
                      uint8_t out[TKV_BLAKE3_OUT_BYTES]) {
    tkv_blake3_keyed_lanes(key, parts, n, out, simd_lanes());
}
