/* Keyed BLAKE3 for the nvme core: the frame MAC of `tierkv.contract.mac`, in C.
 *
 * Why: a tier that signs its frames (`mac_key_env`) paid for the MAC with the whole
 * Python path, one block at a time under the GIL; with the MAC here the core signs and
 * checks each block on its own threads, as it does the checksum. No BLAKE3 library is
 * packaged on the machines this builds on (Debian has only the b3sum tool), so this is
 * the project's own: the portable compression function, and on x86-64 CPUs sixteen
 * chunks at once with AVX-512 or eight with AVX2 (chosen at run time). It answers what `blake3.blake3(key=...)`
 * does for 32-byte digests, which the tests check byte for byte. */
#ifndef TIERKV_BLAKE3_H
#define TIERKV_BLAKE3_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define TKV_BLAKE3_KEY_BYTES 32
#define TKV_BLAKE3_OUT_BYTES 32

/* The keyed BLAKE3 of `parts` joined (n iovecs, any lengths), its first 32 bytes into
 * `out`. Reads the parts only; no allocation (about 24 KiB of stack). Thread-safe. */
void tkv_blake3_keyed(const uint8_t key[TKV_BLAKE3_KEY_BYTES], const struct iovec *parts, int n,
                      uint8_t out[TKV_BLAKE3_OUT_BYTES]);

/* The same with at most `lanes` chunks at once (1, 8 or 16; no more than the CPU's):
 * for tests of each code path on one machine. */
void tkv_blake3_keyed_lanes(const uint8_t key[TKV_BLAKE3_KEY_BYTES], const struct iovec *parts,
                            int n, uint8_t out[TKV_BLAKE3_OUT_BYTES], int lanes);

/* Chunks this CPU hashes side by side: 16 (AVX-512), 8 (AVX2) or 1 (portable). */
int tkv_blake3_lanes(void);

#endif
