/* XXH3-64 for the nvme core: the checksum of every frame (`tierkv.contract.framing`,
 * which Python computes with `xxhash.xxh3_64_intdigest`).
 *
 * Why our own: with it the core needs nothing but a C compiler to build. Linking the
 * xxhash library meant a system package (`libxxhash-dev`) on every machine that builds
 * the core, a shared library on every machine that loads it, and a machine without
 * them (a fresh server, a wheel carried to a GPU host) ran the Python path. This is
 * XXH3's 64-bit hash with seed 0 and the default secret, the only variant frames use:
 * the short-input hashes and, past 240 bytes, the striped accumulation, whose loop runs
 * on AVX-512 or AVX2 when the CPU has them (chosen at run time). It answers what
 * `xxhash.xxh3_64_intdigest` does, which the tests check for every length class and
 * every code path. */
#ifndef TIERKV_XXH3_H
#define TIERKV_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* xxh3_64 of `len` bytes at `data`. Thread-safe, no allocation. */
uint64_t tkv_xxh3_64(const void *data, size_t len);

/* xxh3_64 of `parts` joined (n iovecs, any lengths, empty ones too): the same value as
 * tkv_xxh3_64 of their concatenation, without making it. */
uint64_t tkv_xxh3_64_parts(const struct iovec *parts, int n);

/* The same with the stripe loop on vectors of at most `bits` (512: AVX-512, 256: AVX2,
 * 128: SSE2, 64: portable 64-bit words), no wider than the CPU has: for tests of each code path on
 * one machine. */
uint64_t tkv_xxh3_64_parts_bits(const struct iovec *parts, int n, int bits);

/* The widest vectors the stripe loop runs on with this CPU: 512 (AVX-512), 256 (AVX2),
 * 128 (SSE2, every x86-64) or 64 (portable, other CPUs). */
int tkv_xxh3_vector_bits(void);

#endif
