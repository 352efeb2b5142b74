/* XXH3-64, seed 0, default secret: the frame checksum in C (`_xxh3.h` says why).
 *
 * The algorithm is XXH3's as its specification and `xxhash.xxh3_64_intdigest` define
 * it: up to 240 bytes, one of four fixed mixes of the input with the secret; past that,
 * eight 64-bit accumulators take 64-byte stripes (each lane adds the neighbouring lane's
 * input and the product of its input's two 32-bit halves keyed by the secret), the
 * accumulators are scrambled after every 16 stripes (a 1 KiB block), the last 64 bytes
 * are taken once more with another part of the secret, and the accumulators merge into
 * one value. The stripe loop is written once with GCC vector types, so the compiler
 * makes it for 512-bit (AVX-512), 256-bit (AVX2) or the build's baseline registers, and
 * the CPU picks one at run time. */
#include "_xxh3.h"

#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the nvme core reads frames as little-endian words; this CPU is not (the tier runs its Python path)"
#endif

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

#define STRIPE 64
#define STRIPES_PER_BLOCK 16 /* (secret size - STRIPE) / 8 secret bytes a stripe */
#define SHORT_MAX 240

/* XXH3's default secret (192 bytes, the spec's kSecret). */
static const uint8_t SECRET[192] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define SCRAMBLE_SECRET (SECRET + sizeof SECRET - STRIPE)
#define LAST_STRIPE_SECRET (SECRET + sizeof SECRET - STRIPE - 7)
#define MERGE_SECRET (SECRET + 11)

static inline uint64_t read64(const uint8_t *at) {
    uint64_t value;
    memcpy(&value, at, 8);
    return value;
}

static inline uint32_t read32(const uint8_t *at) {
    uint32_t value;
    memcpy(&value, at, 4);
    return value;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The 128-bit product of a and b, its halves xored. */
static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* XXH64's final mix, which XXH3 uses for inputs of 0-3 bytes. */
static uint64_t avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ULL;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ULL;
    return h ^ (h >> 28);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret) {
    return mul_fold(read64(in) ^ read64(secret), read64(in + 8) ^ read64(secret + 8));
}

/* Inputs of at most SHORT_MAX bytes: XXH3's 0-16, 17-128 and 129-240 byte hashes. */
static uint64_t hash_short(const uint8_t *in, size_t len) {
    const uint8_t *s = SECRET;
    if (len > 8 && len <= 16) {
        uint64_t lo = read64(in) ^ (read64(s + 24) ^ read64(s + 32));
        uint64_t hi = read64(in + len - 8) ^ (read64(s + 40) ^ read64(s + 48));
        return avalanche(len + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (len >= 4 && len <= 8) {
        uint64_t joined = read32(in + len - 4) + ((uint64_t)read32(in) << 32);
        return rrmxmx(joined ^ (read64(s + 8) ^ read64(s + 16)), len);
    }
    if (len > 0 && len < 4) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        return avalanche_xxh64(combined ^ (uint64_t)(read32(s) ^ read32(s + 4)));
    }
    if (len == 0)
        return avalanche_xxh64(read64(s + 56) ^ read64(s + 64));
    uint64_t acc = len * P64_1;
    if (len <= 128) {
        /* Pairs of 16-byte pieces from both ends, as many as the length reaches. */
        for (size_t pair = (len - 1) / 32 + 1; pair-- > 0;)
            acc += mix16(in + 16 * pair, s + 32 * pair) + mix16(in + len - 16 * (pair + 1), s + 32 * pair + 16);
        return avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, s + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < len / 16; i++)
        acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, s + 136 - 17);
    return avalanche(acc);
}

/* ---- the stripe loop ---- */

/* One stripe into the accumulators, with the secret from `secret`: the portable step,
 * also the one for the last stripe. */
static void take_stripe(uint64_t acc[8], const uint8_t *in, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = read64(in + 8 * i);
        uint64_t keyed = data ^ read64(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (keyed & 0xFFFFFFFFu) * (keyed >> 32);
    }
}

static void scramble(uint64_t acc[8]) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i] ^ (acc[i] >> 47) ^ read64(SCRAMBLE_SECRET + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* STRIPES_BODY: `count` whole stripes from `in` into `acc`, the first being stripe `*at`
 * of its block; the secret moves 8 bytes a stripe and the accumulators are scrambled
 * after each block's last (a whole block at once runs with the secret's offsets fixed).
 * Written once over vector operations that each instruction set below defines under
 * its own prefix, the one ISA names where the body is used (SSE2_V, AVX2_V, ...): V (a
 * register), LANES (registers to a stripe), LOAD, STORE, XOR, ADD, MUL_EVEN (the 64-bit
 * products of the 32-bit halves' even lanes), SHR and SHL (64-bit lanes), SWAP_PAIRS
 * (swap neighbouring 64-bit lanes) and SET1 (a 64-bit value in every lane). */
#define ISA_OP_(isa, op) isa##_##op
#define ISA_OP(isa, op) ISA_OP_(isa, op)
#define V ISA_OP(ISA, V)
#define LANES ISA_OP(ISA, LANES)
#define LOAD ISA_OP(ISA, LOAD)
#define STORE ISA_OP(ISA, STORE)
#define XOR ISA_OP(ISA, XOR)
#define ADD ISA_OP(ISA, ADD)
#define MUL_EVEN ISA_OP(ISA, MUL_EVEN)
#define SHR ISA_OP(ISA, SHR)
#define SHL ISA_OP(ISA, SHL)
#define SWAP_PAIRS ISA_OP(ISA, SWAP_PAIRS)
#define SET1 ISA_OP(ISA, SET1)
#define STRIPE_STEP(a, in, secret)                                                              \
    for (int r = 0; r < LANES; r++) {                                                           \
        V data = LOAD((in) + r * (int)sizeof(V));                                               \
        V keyed = XOR(data, LOAD((secret) + r * (int)sizeof(V)));                               \
        a[r] = ADD(a[r], ADD(SWAP_PAIRS(data), MUL_EVEN(keyed, SHR(keyed, 32))));                \
    }
#define SCRAMBLE_STEP(a)                                                                        \
    for (int r = 0; r < LANES; r++) {                                                           \
        V x = XOR(XOR(a[r], SHR(a[r], 47)), LOAD(SCRAMBLE_SECRET + r * (int)sizeof(V)));       \
        a[r] = ADD(MUL_EVEN(x, SET1(P32_1)), SHL(MUL_EVEN(SHR(x, 32), SET1(P32_1)), 32));      \
    }
#define STRIPES_BODY                                                                            \
    V a[LANES];                                                                                 \
    for (int r = 0; r < LANES; r++)                                                             \
        a[r] = LOAD((const uint8_t *)acc + r * (int)sizeof(V));                                 \
    unsigned s = *at;                                                                           \
    while (count > 0) {                                                                         \
        if (s == 0 && count >= STRIPES_PER_BLOCK) {                                             \
            _Pragma("GCC unroll 16") for (int k = 0; k < STRIPES_PER_BLOCK; k++) {              \
                STRIPE_STEP(a, in + STRIPE * k, SECRET + 8 * k)                                 \
            }                                                                                   \
            SCRAMBLE_STEP(a)                                                                    \
            in += STRIPE * STRIPES_PER_BLOCK;                                                   \
            count -= STRIPES_PER_BLOCK;                                                         \
            continue;                                                                           \
        }                                                                                       \
        STRIPE_STEP(a, in, SECRET + 8 * s)                                                      \
        in += STRIPE;                                                                           \
        count--;                                                                                \
        if (++s == STRIPES_PER_BLOCK) {                                                         \
            SCRAMBLE_STEP(a)                                                                    \
            s = 0;                                                                              \
        }                                                                                       \
    }                                                                                           \
    for (int r = 0; r < LANES; r++)                                                             \
        STORE((uint8_t *)acc + r * (int)sizeof(V), a[r]);                                       \
    *at = s;

typedef void (*StripesFn)(uint64_t acc[8], const uint8_t *in, size_t count, unsigned *at);

/* The portable loop: one stripe at a time, 64-bit scalar words (the compiler may
 * vectorize it for the build's baseline). */
static void stripes_portable(uint64_t acc[8], const uint8_t *in, size_t count, unsigned *at) {
    unsigned s = *at;
    for (; count > 0; count--, in += STRIPE) {
        take_stripe(acc, in, SECRET + 8 * s);
        if (++s == STRIPES_PER_BLOCK) {
            scramble(acc);
            s = 0;
        }
    }
    *at = s;
}

#if defined(__x86_64__)
#include <immintrin.h>

#define SSE2_V __m128i
#define SSE2_LANES 4
#define SSE2_LOAD(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define SSE2_STORE(p, v) _mm_storeu_si128((__m128i *)(void *)(p), v)
#define SSE2_XOR _mm_xor_si128
#define SSE2_ADD _mm_add_epi64
#define SSE2_MUL_EVEN _mm_mul_epu32
#define SSE2_SHR _mm_srli_epi64
#define SSE2_SHL _mm_slli_epi64
#define SSE2_SWAP_PAIRS(v) _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2))
#define SSE2_SET1(x) _mm_set1_epi64x((long long)(x))

#define AVX2_V __m256i
#define AVX2_LANES 2
#define AVX2_LOAD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define AVX2_STORE(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), v)
#define AVX2_XOR _mm256_xor_si256
#define AVX2_ADD _mm256_add_epi64
#define AVX2_MUL_EVEN _mm256_mul_epu32
#define AVX2_SHR _mm256_srli_epi64
#define AVX2_SHL _mm256_slli_epi64
#define AVX2_SWAP_PAIRS(v) _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2))
#define AVX2_SET1(x) _mm256_set1_epi64x((long long)(x))

#define AVX512_V __m512i
#define AVX512_LANES 1
#define AVX512_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define AVX512_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define AVX512_XOR _mm512_xor_si512
#define AVX512_ADD _mm512_add_epi64
#define AVX512_MUL_EVEN _mm512_mul_epu32
#define AVX512_SHR _mm512_srli_epi64
#define AVX512_SHL _mm512_slli_epi64
#define AVX512_SWAP_PAIRS(v) _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))
#define AVX512_SET1(x) _mm512_set1_epi64((long long)(x))

/* SSE2: every x86-64 CPU has it. */
#define ISA SSE2
static void stripes_sse2(uint64_t acc[8], const uint8_t *in, size_t count, unsigned *at) {
    STRIPES_BODY
}
#undef ISA

#define ISA AVX2
__attribute__((target("avx2"))) static void stripes_avx2(uint64_t acc[8], const uint8_t *in,
                                                          size_t count, unsigned *at) {
    STRIPES_BODY
}
#undef ISA

#define ISA AVX512
__attribute__((target("avx512f"))) static void stripes_avx512(uint64_t acc[8], const uint8_t *in,
                                                              size_t count, unsigned *at) {
    STRIPES_BODY
}
#undef ISA

int tkv_xxh3_vector_bits(void) {
    static int known = 0;
    if (known == 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 512 : __builtin_cpu_supports("avx2") ? 256 : 128;
    }
    return known;
}

static StripesFn stripes_for(int bits) {
    bits = bits < tkv_xxh3_vector_bits() ? bits : tkv_xxh3_vector_bits();
    return bits >= 512   ? stripes_avx512
           : bits >= 256 ? stripes_avx2
           : bits >= 128 ? stripes_sse2
                         : stripes_portable;
}
#else
int tkv_xxh3_vector_bits(void) { return 64; }

static StripesFn stripes_for(int bits) { return stripes_portable; }
#endif

/* ---- inputs in parts ---- */

/* `len` bytes of the parts joined, from `from` on, into `out`. */
static void gather(const struct iovec *parts, int n, size_t from, size_t len, uint8_t *out) {
    for (int i = 0; i < n && len > 0; i++) {
        size_t size = parts[i].iov_len;
        if (from >= size) {
            from -= size;
            continue;
        }
        size_t take = size - from < len ? size - from : len;
        memcpy(out, (const uint8_t *)parts[i].iov_base + from, take);
        out += take;
        len -= take;
        from = 0;
    }
}

/* The accumulators merged into the hash of `total` bytes. */
static uint64_t merge(const uint64_t acc[8], uint64_t total) {
    uint64_t result = total * P64_1;
    for (int i = 0; i < 4; i++)
        result += mul_fold(acc[2 * i] ^ read64(MERGE_SECRET + 16 * i),
                           acc[2 * i + 1] ^ read64(MERGE_SECRET + 16 * i + 8));
    return avalanche(result);
}

uint64_t tkv_xxh3_64_parts_bits(const struct iovec *parts, int n, int bits) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += parts[i].iov_len;
    if (total <= SHORT_MAX) {
        uint8_t joined[SHORT_MAX];
        gather(parts, n, 0, total, joined);
        return hash_short(joined, total);
    }
    StripesFn run = stripes_for(bits);
    uint64_t acc[8] __attribute__((aligned(64))) = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    unsigned at = 0;
    /* Every whole stripe before the last byte, straight from each part; a stripe that
     * straddles two parts is put together in `carry`. */
    size_t todo = (total - 1) / STRIPE * STRIPE;
    uint8_t carry[STRIPE];
    size_t held = 0;
    for (int i = 0; i < n && todo > 0; i++) {
        const uint8_t *p = parts[i].iov_base;
        size_t len = parts[i].iov_len < todo ? parts[i].iov_len : todo;
        todo -= len;
        if (held > 0) {
            size_t take = STRIPE - held < len ? STRIPE - held : len;
            memcpy(carry + held, p, take);
            held += take;
            p += take;
            len -= take;
            if (held < STRIPE)
                continue;
            run(acc, carry, 1, &at);
            held = 0;
        }
        if (len >= STRIPE)
            run(acc, p, len / STRIPE, &at);
        held = len % STRIPE;
        memcpy(carry, p + len - held, held);
    }
    /* The last 64 bytes once more, with their own part of the secret. */
    const uint8_t *last = NULL;
    for (int i = n - 1; i >= 0 && last == NULL; i--)
        if (parts[i].iov_len >= STRIPE)
            last = (const uint8_t *)parts[i].iov_base + parts[i].iov_len - STRIPE;
        else if (parts[i].iov_len > 0)
            break;
    if (last == NULL) {
        gather(parts, n, total - STRIPE, STRIPE, carry);
        last = carry;
    }
    take_stripe(acc, last, LAST_STRIPE_SECRET);
    return merge(acc, total);
}

uint64_t tkv_xxh3_64_parts(const struct iovec *parts, int n) {
    return tkv_xxh3_64_parts_bits(parts, n, 512);
}

uint64_t tkv_xxh3_64(const void *data, size_t len) {
    if (len <= SHORT_MAX)
        return hash_short(data, len);
    struct iovec one = {(void *)data, len};
    return tkv_xxh3_64_parts_bits(&one, 1, 512);
}
