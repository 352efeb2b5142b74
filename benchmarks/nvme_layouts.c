/* nvme_layouts: the nvme tier's on-disk layouts measured side by side (issue 51, item 2).
 *
 * One block per file (what tiers/nvme does today, and variants of its frame) against
 * slabs (a few large preallocated files of fixed slots), buffered and O_DIRECT, and
 * rawio.c's plain files without a frame as the reference. No Python, no tierkv: the
 * system calls and checksums each layout costs per block, and nothing else.
 *
 * Layouts (block i of N, B bytes of payload, key of 36 bytes):
 *   files        <dir>/<2 hex>/<key hex>.blk, frame = 70-byte header | payload, written
 *                as the tier's _batchio.c does: openat2(tmp, O_CREAT|O_EXCL, beneath, no
 *                links), pwritev(header, payload), [fdatasync], close, renameat onto
 *                the name; read: openat2(O_NOATIME), groups of 16 probed with
 *                RWF_NOWAIT, the rest advised WILLNEED together, one preadv(header,
 *                payload, spare byte), length + header fields + xxh3_64 checked, close.
 *   files-pad    the same with the header padded to 4096 bytes: the payload page-aligned
 *                in the file (and in the page cache).
 *   files-trail  the same with the header after the payload (payload at offset 0).
 *   slab         S files (fallocate'd) of fixed slots, slot = payload | 4096-byte header
 *                page (header in its first sector: the frame's fields + key + write
 *                sequence + xxh3 of the header); block i in slab i % S, slot i / S. Write:
 *                one pwritev2(payload, header page) at the slot ([RWF_DSYNC]); read: the
 *                same groups, probe and WILLNEED as files, one preadv(payload, 128
 *                header bytes). Slab descriptors stay open: no open/close per block.
 *   slab-direct  slab with O_DIRECT: the same slots, aligned buffers, groups of 16 as
 *                one io_submit (Linux AIO, queue depth 16 per thread; --qd 1: plain
 *                pwritev2/preadv2 per block); reads take payload + one 512-byte sector.
 *   raw          rawio.c: <dir>/<i & 0xff>/<i>.blk, open(path, O_CREAT|O_TRUNC) +
 *                pwrite + [fdatasync] + close; open(O_NOATIME) + pread + close. No frame,
 *                no checksum, no temp file: the floor of any one-file-per-block layout.
 *
 * Phases (in the order given): write (fresh: new files / unwritten slab extents),
 * rewrite (every block again under a new key, as a full tier's store that evicts one
 * block per block: files get a new file and unlink the old one; slots are overwritten
 * in place), flush (syncfs: what the writes left dirty reaching the disk), read (warm:
 * the page cache as the writes left it), cold (syncfs, posix_fadvise(DONTNEED) on every
 * file/slab, untimed; then read).
 * One JSON line per phase: seconds, GB/s of payload, CPU us per block (the process's
 * user + system time: the kernel's own writeback threads are not in it).
 *
 * Build: cc -O2 -std=gnu11 -pthread -o nvme_layouts nvme_layouts.c ../tiers/nvme/tierkv_nvme/_xxh3.c
 * Usage: nvme_layouts LAYOUT DIR BLOCK_BYTES BLOCKS THREADS PHASES
 *                     [--fsync] [--qd N] [--slabs N] [--verify] [--keep]
 * DIR must not exist (it is created, and removed with everything in it at the end).
 * The driver is nvme_layouts.py.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/aio_abi.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include "../tiers/nvme/tierkv_nvme/_xxh3.h"
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h> /* as _batchio.c: AVX2/AVX-512 picked at run time */
#endif
#endif

enum { FILES, FILES_PAD, FILES_TRAIL, SLAB, SLAB_DIRECT, RAW, NLAYOUTS };
static const char *LAYOUT_NAMES[NLAYOUTS] = {"files", "files-pad", "files-trail",
                                             "slab",  "slab-direct", "raw"};
enum { P_WRITE, P_REWRITE, P_FLUSH, P_READ, P_COLD, P_SCAN };

#define KEY_BYTES 36
#define FIXED_HEADER_BYTES 34
#define HEAD (FIXED_HEADER_BYTES + KEY_BYTES) /* the tier's frame header: 70 bytes */
#define PAGE 4096
#define SECTOR 512
#define GROUP 16           /* _batchio.c PREFETCH_BLOCKS */
#define SLAB_HEAD_USED 86  /* slab header: frame fields + key + sequence + its own xxh3 */
#define SLAB_HEAD_READ 128 /* buffered slab reads take this much of the header page */
#define MAX_THREADS 16
#define MAX_SLABS 64
#define RING_BYTES ((size_t)64 << 20) /* source ring (writes), per-thread ring (reads) */
#define NOT_CACHED 100
#define NS_HASH 0x5eedf00dcafe1234ull

static int layout, nthreads = 1, fsync_on, qd = GROUP, nslabs = 4, verify, keep;
static const char *dir;
static size_t bs, n;
static int dir_fd = -1;
static unsigned char (*keys)[KEY_BYTES];
static char (*names)[96];  /* "ab/<72 hex>.blk" */
static char (*tmps)[128];  /* "ab/.<72 hex>.blk.<pid>-<i>.tmp" */
static unsigned char *src; /* payload of block i: src + (i % src_slots) * bs */
static size_t src_slots;
static int slab_fd[MAX_SLABS];
static size_t slot_size, slots_per_slab;
static uint64_t write_seq;
static size_t gen; /* keys of generation 0 (write), 1 (rewrite), 0 (next rewrite)... */
#define KEY(i) keys[gen * n + (i)]
#define NAME(i) names[gen * n + (i)]
#define TMP(i) tmps[gen * n + (i)]
#define OLD_NAME(i) names[(gen ^ 1) * n + (i)]
static atomic_size_t next_group;
static atomic_long errors;
static atomic_int nowait_works = 1;
static int phase;

typedef struct {
    unsigned char *dst; /* read ring */
    size_t dst_slots, used;
    unsigned char *hdr; /* GROUP header pages, page-aligned */
    aio_context_t aio;
} Ctx;

static void fail(const char *what) {
    perror(what);
    exit(1);
}

static void bad(size_t i, const char *what, long code) {
    if (atomic_fetch_add(&errors, 1) < 5)
        fprintf(stderr, "block %zu: %s (%ld)\n", i, what, code);
}

static void put_le(unsigned char *at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; i++)
        at[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t get_le(const unsigned char *at, int bytes) {
    uint64_t value = 0;
    for (int i = bytes - 1; i >= 0; i--)
        value = (value << 8) | at[i];
    return value;
}

static uint64_t splitmix(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const unsigned char *payload_of(size_t i) { return src + (i % src_slots) * bs; }

/* -- frames ------------------------------------------------------------------------- */

/* The tier's frame header (_batchio.c build_header): 70 bytes into h. */
static void frame_header(unsigned char *h, size_t i, const unsigned char *payload) {
    memcpy(h, "TKVB", 4);
    put_le(h + 4, 1, 2);
    put_le(h + 6, 0, 2);
    put_le(h + 8, NS_HASH, 8);
    put_le(h + 16, bs, 8);
    put_le(h + 24, tkv_xxh3_64(payload, bs), 8);
    put_le(h + 32, KEY_BYTES, 2);
    memcpy(h + FIXED_HEADER_BYTES, KEY(i), KEY_BYTES);
}

/* _batchio.c check_frame: every field, then the payload's checksum. */
static int frame_ok(const unsigned char *h, size_t i, const unsigned char *payload) {
    return memcmp(h, "TKVB", 4) == 0 && get_le(h + 4, 2) == 1 && get_le(h + 6, 2) == 0 &&
           get_le(h + 8, 8) == NS_HASH && get_le(h + 32, 2) == KEY_BYTES &&
           memcmp(h + FIXED_HEADER_BYTES, KEY(i), KEY_BYTES) == 0 && get_le(h + 16, 8) == bs &&
           get_le(h + 24, 8) == tkv_xxh3_64(payload, bs);
}

/* A slot's header: the frame's fields and key, the write's sequence number (the
 * newest of two slots naming one key wins a rebuild), and an xxh3 of the header itself
 * (a torn or stale header page reads as an empty slot). */
static void slab_header(unsigned char *h, size_t i, const unsigned char *payload) {
    memcpy(h, "TKVS", 4);
    put_le(h + 4, 1, 2);
    put_le(h + 6, 0, 2);
    put_le(h + 8, NS_HASH, 8);
    put_le(h + 16, bs, 8);
    put_le(h + 24, tkv_xxh3_64(payload, bs), 8);
    put_le(h + 32, KEY_BYTES, 2);
    memcpy(h + FIXED_HEADER_BYTES, KEY(i), KEY_BYTES);
    put_le(h + HEAD, write_seq + i, 8);
    put_le(h + HEAD + 8, tkv_xxh3_64(h, HEAD + 8), 8);
}

static int slab_ok(const unsigned char *h, size_t i, const unsigned char *payload) {
    return memcmp(h, "TKVS", 4) == 0 && get_le(h + HEAD + 8, 8) == tkv_xxh3_64(h, HEAD + 8) &&
           get_le(h + 4, 2) == 1 && get_le(h + 6, 2) == 0 && get_le(h + 8, 8) == NS_HASH &&
           get_le(h + 32, 2) == KEY_BYTES &&
           memcmp(h + FIXED_HEADER_BYTES, KEY(i), KEY_BYTES) == 0 && get_le(h + 16, 8) == bs &&
           get_le(h + 24, 8) == tkv_xxh3_64(payload, bs);
}

static void check_payload(size_t i, const unsigned char *got) {
    if (verify && memcmp(got, payload_of(i), bs) != 0)
        bad(i, "payload differs", 0);
}

/* -- vectored I/O to the end (_batchio.c write_all / read_all) ---------------------- */

static struct iovec *advance(struct iovec *iov, int *cnt, size_t done) {
    while (*cnt && done >= iov->iov_len) {
        done -= iov->iov_len;
        iov++;
        (*cnt)--;
    }
    if (*cnt) {
        iov->iov_base = (char *)iov->iov_base + done;
        iov->iov_len -= done;
    }
    return iov;
}

static int write_all(int fd, struct iovec *iov, int cnt, off_t offset, int flags) {
    while (cnt) {
        ssize_t put = pwritev2(fd, iov, cnt, offset, flags);
        if (put < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (put == 0)
            return -EIO;
        offset += put;
        iov = advance(iov, &cnt, (size_t)put);
    }
    return 0;
}

static ssize_t read_all(int fd, struct iovec *iov, int cnt, off_t offset, int flags) {
    ssize_t total = 0;
    while (cnt) {
        ssize_t got = preadv2(fd, iov, cnt, offset + total, flags);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            break;
        total += got;
        iov = advance(iov, &cnt, (size_t)got);
        if (flags)
            break;
    }
    return total;
}

/* -- files -------------------------------------------------------------------------- */

static int open_beneath(const char *name, int flags, mode_t mode) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (uint64_t)flags | O_CLOEXEC;
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH;
    int fd = (int)syscall(SYS_openat2, dir_fd, name, &how, sizeof how);
    return fd < 0 ? -errno : fd;
}

static size_t head_area(void) { return layout == FILES_PAD ? PAGE : HEAD; }

/* iov for a frame file: header (area bytes) and payload in the layout's order, then
 * `spare` (reads: a byte that must stay unread). */
static int frame_iov(struct iovec *iov, unsigned char *h, unsigned char *payload,
                     unsigned char *spare) {
    struct iovec head = {h, head_area()}, body = {payload, bs};
    iov[0] = layout == FILES_TRAIL ? body : head;
    iov[1] = layout == FILES_TRAIL ? head : body;
    if (!spare)
        return 2;
    iov[2] = (struct iovec){spare, 1};
    return 3;
}

static void files_write(Ctx *c, size_t i) {
    unsigned char *h = c->hdr; /* zero past the 70 bytes (files-pad) */
    unsigned char *payload = (unsigned char *)payload_of(i);
    frame_header(h, i, payload);
    int fd = open_beneath(TMP(i), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return bad(i, "open tmp", fd);
    struct iovec iov[3];
    int cnt = frame_iov(iov, h, payload, NULL);
    int err = write_all(fd, iov, cnt, 0, 0);
    if (!err && fsync_on && fdatasync(fd) != 0)
        err = -errno;
    if (close(fd) != 0 && !err)
        err = -errno;
    if (!err && renameat(dir_fd, TMP(i), dir_fd, NAME(i)) != 0)
        err = -errno;
    if (err) {
        unlinkat(dir_fd, TMP(i), 0);
        bad(i, "write", err);
    }
    /* a rewrite stores new keys: the old generation's file goes, as an eviction's */
    if (phase == P_REWRITE && unlinkat(dir_fd, OLD_NAME(i), 0) != 0)
        bad(i, "unlink old", -errno);
}

static unsigned char *next_dst(Ctx *c) {
    unsigned char *d = c->dst + (c->used++ % c->dst_slots) * bs;
    if (verify)
        memset(d, 0, bs);
    return d;
}

/* _batchio.c read_one: one preadv of the frame and a spare byte; NOT_CACHED when a
 * RWF_NOWAIT probe decides nothing. */
static long files_read_one(Ctx *c, size_t i, int fd, unsigned char *d, int nowait) {
    unsigned char spare;
    struct iovec iov[3];
    int cnt = frame_iov(iov, c->hdr, d, &spare);
    size_t expected = head_area() + bs;
    ssize_t got = read_all(fd, iov, cnt, 0, nowait ? RWF_NOWAIT : 0);
    if (nowait) {
        if (got == -EOPNOTSUPP || got == -EINVAL || got == -ENOSYS)
            atomic_store(&nowait_works, 0);
        if (got < 0 || (size_t)got < expected)
            return NOT_CACHED;
        if ((size_t)got == expected && expected % PAGE == 0) {
            /* the spare byte's page may just be uncached: the tier's frames (never a page
             * multiple) re-read; a padded frame, always one, asks the length instead */
            struct stat st;
            if (layout != FILES_PAD || fstat(fd, &st) != 0 || (size_t)st.st_size != expected)
                return NOT_CACHED;
        }
    }
    if (got < 0)
        return got;
    if ((size_t)got != expected)
        return -EBADMSG;
    if (!frame_ok(c->hdr, i, d))
        return -EBADMSG;
    check_payload(i, d);
    return 0;
}

/* _batchio.c read_group: open each, read it now if the page cache has it whole; from
 * the first it does not, advise the rest together and read them. */
static void files_read_group(Ctx *c, size_t first, size_t end) {
    int fds[GROUP];
    unsigned char *dst[GROUP];
    size_t cold[GROUP], ncold = 0;
    int cached = atomic_load(&nowait_works);
    for (size_t i = first; i < end; i++) {
        int fd = open_beneath(NAME(i), O_RDONLY | O_NOFOLLOW | O_NOATIME, 0);
        fds[i - first] = fd;
        dst[i - first] = next_dst(c);
        if (fd < 0) {
            bad(i, "open", fd);
            continue;
        }
        long code = cached ? files_read_one(c, i, fd, dst[i - first], 1) : NOT_CACHED;
        if (code == NOT_CACHED) {
            cold[ncold++] = i;
            cached = 0;
        } else if (code) {
            bad(i, "read", code);
        }
    }
    if (ncold > 1)
        for (size_t k = 0; k < ncold; k++)
            posix_fadvise(fds[cold[k] - first], 0, 0, POSIX_FADV_WILLNEED);
    for (size_t k = 0; k < ncold; k++) {
        size_t i = cold[k];
        long code = files_read_one(c, i, fds[i - first], dst[i - first], 0);
        if (code)
            bad(i, "read", code);
    }
    for (size_t i = first; i < end; i++)
        if (fds[i - first] >= 0)
            close(fds[i - first]);
}

/* -- raw (rawio.c) ------------------------------------------------------------------ */

static void raw_path(char *path, size_t size, size_t i, size_t g) {
    snprintf(path, size, "%s/%02zx/%zu-%zu.blk", dir, i & 0xff, i, g);
}

static void raw_write(size_t i) {
    char path[4096];
    raw_path(path, sizeof path, i, gen);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return bad(i, "open", -errno);
    if (pwrite(fd, payload_of(i), bs, 0) != (ssize_t)bs)
        bad(i, "pwrite", -errno);
    if (fsync_on && fdatasync(fd) != 0)
        bad(i, "fdatasync", -errno);
    close(fd);
    if (phase == P_REWRITE) {
        raw_path(path, sizeof path, i, gen ^ 1);
        if (unlink(path) != 0)
            bad(i, "unlink old", -errno);
    }
}

static void raw_read(Ctx *c, size_t i) {
    char path[4096];
    raw_path(path, sizeof path, i, gen);
    int fd = open(path, O_RDONLY | O_NOATIME);
    if (fd < 0)
        return bad(i, "open", -errno);
    unsigned char *d = next_dst(c);
    if (pread(fd, d, bs, 0) != (ssize_t)bs)
        bad(i, "pread", -errno);
    else
        check_payload(i, d);
    close(fd);
}

/* -- slabs -------------------------------------------------------------------------- */

static int slab_of(size_t i) { return (int)(i % (size_t)nslabs); }
static off_t slot_offset(size_t i) { return (off_t)((i / (size_t)nslabs) * slot_size); }

static void slab_write(Ctx *c, size_t i) {
    unsigned char *h = c->hdr;
    unsigned char *payload = (unsigned char *)payload_of(i);
    slab_header(h, i, payload);
    struct iovec iov[2] = {{payload, bs}, {h, PAGE}};
    int err = write_all(slab_fd[slab_of(i)], iov, 2, slot_offset(i), fsync_on ? RWF_DSYNC : 0);
    if (err)
        bad(i, "write", err);
}

static long slab_read_one(unsigned char *h, size_t i, unsigned char *d, int nowait) {
    size_t head = layout == SLAB_DIRECT ? SECTOR : SLAB_HEAD_READ;
    struct iovec iov[2] = {{d, bs}, {h, head}};
    ssize_t got = read_all(slab_fd[slab_of(i)], iov, 2, slot_offset(i), nowait ? RWF_NOWAIT : 0);
    if (nowait) {
        if (got == -EOPNOTSUPP || got == -EINVAL || got == -ENOSYS)
            atomic_store(&nowait_works, 0);
        if (got < 0 || (size_t)got < bs + head)
            return NOT_CACHED;
    }
    if (got < 0)
        return got;
    if ((size_t)got != bs + head || !slab_ok(h, i, d))
        return -EBADMSG;
    check_payload(i, d);
    return 0;
}

/* Buffered slab reads, grouped as files_read_group (no opens: the slabs stay open). */
static void slab_read_group(Ctx *c, size_t first, size_t end) {
    unsigned char *dst[GROUP];
    size_t cold[GROUP], ncold = 0;
    int cached = atomic_load(&nowait_works);
    for (size_t i = first; i < end; i++) {
        dst[i - first] = next_dst(c);
        long code = cached ? slab_read_one(c->hdr, i, dst[i - first], 1) : NOT_CACHED;
        if (code == NOT_CACHED) {
            cold[ncold++] = i;
            cached = 0;
        } else if (code) {
            bad(i, "read", code);
        }
    }
    if (ncold > 1)
        for (size_t k = 0; k < ncold; k++)
            posix_fadvise(slab_fd[slab_of(cold[k])], slot_offset(cold[k]),
                          (off_t)(bs + SLAB_HEAD_READ), POSIX_FADV_WILLNEED);
    for (size_t k = 0; k < ncold; k++) {
        size_t i = cold[k];
        long code = slab_read_one(c->hdr, i, dst[i - first], 0);
        if (code)
            bad(i, "read", code);
    }
}

/* O_DIRECT slots, a group at a time: one io_submit of up to GROUP, then all reaped
 * (--qd 1: one synchronous call per block). */
static void direct_group(Ctx *c, size_t first, size_t end, int writing) {
    size_t cnt = end - first;
    struct iovec iov[GROUP][2];
    struct iocb cbs[GROUP], *cbp[GROUP];
    unsigned char *dst[GROUP];
    for (size_t k = 0; k < cnt; k++) {
        size_t i = first + k;
        unsigned char *h = c->hdr + k * PAGE;
        if (writing) {
            unsigned char *payload = (unsigned char *)payload_of(i);
            slab_header(h, i, payload);
            iov[k][0] = (struct iovec){payload, bs};
            iov[k][1] = (struct iovec){h, PAGE};
        } else {
            dst[k] = next_dst(c);
            iov[k][0] = (struct iovec){dst[k], bs};
            iov[k][1] = (struct iovec){h, SECTOR};
        }
        if (qd == 1) {
            if (writing) {
                int err = write_all(slab_fd[slab_of(i)], iov[k], 2, slot_offset(i),
                                    fsync_on ? RWF_DSYNC : 0);
                if (err)
                    bad(i, "write", err);
            } else {
                long code = slab_read_one(h, i, dst[k], 0);
                if (code)
                    bad(i, "read", code);
            }
            continue;
        }
        memset(&cbs[k], 0, sizeof cbs[k]);
        cbs[k].aio_fildes = (uint32_t)slab_fd[slab_of(i)];
        cbs[k].aio_lio_opcode = writing ? IOCB_CMD_PWRITEV : IOCB_CMD_PREADV;
        cbs[k].aio_buf = (uint64_t)(uintptr_t)iov[k];
        cbs[k].aio_nbytes = 2;
        cbs[k].aio_offset = slot_offset(i);
        cbs[k].aio_data = k;
        cbs[k].aio_rw_flags = writing && fsync_on ? RWF_DSYNC : 0;
        cbp[k] = &cbs[k];
    }
    if (qd == 1)
        return;
    size_t submitted = 0, reaped = 0;
    while (submitted < cnt) {
        long got = syscall(SYS_io_submit, c->aio, (long)(cnt - submitted), cbp + submitted);
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            fail("io_submit");
        }
        submitted += (size_t)got;
    }
    struct io_event events[GROUP];
    while (reaped < cnt) {
        long got = syscall(SYS_io_getevents, c->aio, 1L, (long)(cnt - reaped), events, NULL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            fail("io_getevents");
        }
        for (long e = 0; e < got; e++) {
            size_t k = (size_t)events[e].data, i = first + k;
            size_t want = bs + (writing ? PAGE : SECTOR);
            if (events[e].res != (int64_t)want)
                bad(i, writing ? "aio write" : "aio read", (long)events[e].res);
            else if (!writing && !slab_ok(c->hdr + k * PAGE, i, dst[k]))
                bad(i, "slot check", 0);
            else if (!writing)
                check_payload(i, dst[k]);
        }
        reaped += (size_t)got;
    }
}

/* -- the index rebuild: what `open` scans ---------------------------------------------- */

static atomic_size_t found, next_fanout;

/* One fan-out directory as recovery.py checks it: every `.blk` opened, its header read
 * and parsed, its length and its key (against the name) checked; raw: its length. */
static void scan_fanout(Ctx *c, int d) {
    char fan[8];
    snprintf(fan, sizeof fan, "%02x", d);
    int dfd = openat(dir_fd, fan, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *listing = dfd < 0 ? NULL : fdopendir(dfd);
    if (listing == NULL)
        return bad((size_t)d, "open fan-out", -errno);
    struct dirent *e;
    while ((e = readdir(listing)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".blk") != 0)
            continue;
        struct stat st;
        if (layout == RAW) {
            if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && (size_t)st.st_size == bs)
                atomic_fetch_add(&found, 1);
            continue;
        }
        int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NOATIME | O_CLOEXEC);
        if (fd < 0)
            continue;
        unsigned char *h = c->hdr;
        off_t at = layout == FILES_TRAIL ? (off_t)bs : 0;
        int ok = pread(fd, h, HEAD, at) == HEAD && fstat(fd, &st) == 0 &&
                 (size_t)st.st_size == head_area() + bs && memcmp(h, "TKVB", 4) == 0 &&
                 get_le(h + 4, 2) == 1 && get_le(h + 6, 2) == 0 &&
                 get_le(h + 8, 8) == NS_HASH && get_le(h + 16, 8) == bs &&
                 get_le(h + 32, 2) == KEY_BYTES && len == 2 * KEY_BYTES + 4;
        for (int b = 0; ok && b < KEY_BYTES; b++) {
            char hex[3];
            snprintf(hex, sizeof hex, "%02x", h[FIXED_HEADER_BYTES + b]);
            ok = memcmp(hex, e->d_name + 2 * b, 2) == 0;
        }
        if (ok)
            atomic_fetch_add(&found, 1);
        close(fd);
    }
    closedir(listing);
}

static void *scan_worker(void *arg) {
    int d;
    while ((d = (int)atomic_fetch_add(&next_fanout, 1)) < 256)
        scan_fanout(arg, d);
    return NULL;
}

/* Slots: each slot's header read where it lies (after the payload) and checked; the key
 * compared with the expected one stands for the index insert. */
static void scan_slots(Ctx *c, size_t first, size_t end) {
    size_t head = layout == SLAB_DIRECT ? SECTOR : SLAB_HEAD_READ;
    for (size_t i = first; i < end; i++) {
        unsigned char *h = c->hdr;
        if (pread(slab_fd[slab_of(i)], h, head, slot_offset(i) + (off_t)bs) != (ssize_t)head)
            continue;
        if (memcmp(h, "TKVS", 4) == 0 && get_le(h + HEAD + 8, 8) == tkv_xxh3_64(h, HEAD + 8) &&
            get_le(h + 8, 8) == NS_HASH && get_le(h + 16, 8) == bs &&
            memcmp(h + FIXED_HEADER_BYTES, KEY(i), KEY_BYTES) == 0)
            atomic_fetch_add(&found, 1);
    }
}

/* -- phases ------------------------------------------------------------------------- */

static void run_group(Ctx *c, size_t first, size_t end) {
    int writing = phase == P_WRITE || phase == P_REWRITE;
    if (phase == P_SCAN)
        return scan_slots(c, first, end);
    if (layout == SLAB_DIRECT)
        return direct_group(c, first, end, writing);
    if (!writing && layout == SLAB)
        return slab_read_group(c, first, end);
    if (!writing && layout != RAW)
        return files_read_group(c, first, end);
    for (size_t i = first; i < end; i++) {
        if (layout == RAW)
            writing ? raw_write(i) : raw_read(c, i);
        else if (layout == SLAB)
            slab_write(c, i);
        else
            files_write(c, i);
    }
}

static size_t group_size;

static void *worker(void *arg) {
    Ctx *c = arg;
    size_t g;
    while ((g = atomic_fetch_add(&next_group, 1)) * group_size < n) {
        size_t first = g * group_size;
        run_group(c, first, first + group_size < n ? first + group_size : n);
    }
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double cpu_now(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

/* Pages of `fd` (size bytes) still in the page cache, by mincore. */
static size_t resident_pages(int fd, size_t size) {
    size_t pages = (size + PAGE - 1) / PAGE, count = 0;
    void *map = size ? mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    unsigned char *vec = malloc(pages ? pages : 1);
    if (map != MAP_FAILED && vec && mincore(map, size, vec) == 0)
        for (size_t p = 0; p < pages; p++)
            count += vec[p] & 1;
    if (map != MAP_FAILED)
        munmap(map, size);
    free(vec);
    return count;
}

/* DONTNEED of every file or slab (after syncfs: clean pages only), once more where
 * pages stayed (a folio still in a per-CPU batch); the pages left are reported. */
static size_t resident_after_drop;

static void drop_cache(void) {
    if (syncfs(dir_fd) != 0)
        fail("syncfs");
    resident_after_drop = 0;
    size_t files = layout == SLAB || layout == SLAB_DIRECT ? (size_t)nslabs : n;
    for (size_t i = 0; i < files; i++) {
        char path[4096];
        int fd;
        if (layout == SLAB || layout == SLAB_DIRECT) {
            fd = dup(slab_fd[i]);
        } else if (layout == RAW) {
            raw_path(path, sizeof path, i, gen);
            fd = open(path, O_RDONLY);
        } else {
            fd = openat(dir_fd, NAME(i), O_RDONLY | O_NOFOLLOW);
        }
        if (fd < 0)
            fail("open for DONTNEED");
        struct stat st;
        if (fstat(fd, &st) != 0)
            fail("fstat");
        size_t left = 0;
        for (int tries = 0; tries < 3; tries++) {
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            if ((left = resident_pages(fd, (size_t)st.st_size)) == 0)
                break;
        }
        resident_after_drop += left;
        close(fd);
    }
}

static void report(const char *name, double seconds, double cpu) {
    printf("{\"layout\":\"%s\",\"phase\":\"%s\",\"block_bytes\":%zu,\"blocks\":%zu,"
           "\"threads\":%d,\"fsync\":%s,\"qd\":%d,\"seconds\":%.4f,\"GBps\":%.3f,"
           "\"cpu_us_per_block\":%.2f,\"errors\":%ld,\"resident_pages\":%zd}\n",
           LAYOUT_NAMES[layout], name, bs, n, nthreads, fsync_on ? "true" : "false",
           layout == SLAB_DIRECT ? qd : 0, seconds, (double)n * (double)bs / seconds / 1e9,
           cpu / (double)n * 1e6, atomic_load(&errors),
           phase == P_COLD || phase == P_SCAN ? (ssize_t)resident_after_drop : (ssize_t)-1);
    fflush(stdout);
}

static void run_phase(Ctx *ctxs, const char *name) {
    int slabs = layout == SLAB || layout == SLAB_DIRECT;
    if (phase == P_COLD || phase == P_SCAN)
        drop_cache();
    for (int s = 0; slabs && phase == P_SCAN && s < nslabs; s++)
        posix_fadvise(slab_fd[s], 0, 0, POSIX_FADV_RANDOM); /* no read-ahead of payloads */
    atomic_store(&found, 0);
    atomic_store(&next_fanout, 0);
    if (phase == P_REWRITE)
        gen ^= 1;
    double cpu = cpu_now(), t = now();
    if (phase == P_FLUSH) {
        if (syncfs(dir_fd) != 0)
            fail("syncfs");
    } else {
        atomic_store(&next_group, 0);
        size_t share = (n + (size_t)nthreads - 1) / (size_t)nthreads;
        group_size = share < GROUP ? (share ? share : 1) : GROUP;
        void *(*fn)(void *) = phase == P_SCAN && !slabs ? scan_worker : worker;
        pthread_t ids[MAX_THREADS];
        for (int k = 1; k < nthreads; k++)
            if (pthread_create(&ids[k], NULL, fn, &ctxs[k]) != 0)
                fail("pthread_create");
        fn(&ctxs[0]);
        for (int k = 1; k < nthreads; k++)
            pthread_join(ids[k], NULL);
    }
    t = now() - t;
    cpu = cpu_now() - cpu;
    for (int s = 0; slabs && phase == P_SCAN && s < nslabs; s++)
        posix_fadvise(slab_fd[s], 0, 0, POSIX_FADV_NORMAL);
    if (phase == P_SCAN && atomic_load(&found) != n)
        bad(atomic_load(&found), "scan found (of all blocks)", (long)n);
    report(name, t, cpu);
    if (phase == P_WRITE || phase == P_REWRITE)
        write_seq += n;
}

/* -- setup and cleanup -------------------------------------------------------------- */

static void *map_pages(size_t bytes) {
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        fail("mmap");
    return m;
}

static void setup(void) {
    if (mkdir(dir, 0700) != 0)
        fail(dir);
    dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0)
        fail(dir);
    keys = calloc(2 * n, sizeof *keys);
    names = calloc(2 * n, sizeof *names);
    tmps = calloc(2 * n, sizeof *tmps);
    if (!keys || !names || !tmps)
        fail("calloc");
    uint64_t state = 42;
    for (size_t i = 0; i < 2 * n; i++) {
        if (i < n) {
            for (int w = 0; w < 4; w++)
                put_le(keys[i] + 8 * w, splitmix(&state), 8);
            put_le(keys[i] + 32, i, 4);
        } else { /* generation 1: the same key but its last byte */
            memcpy(keys[i], keys[i - n], KEY_BYTES);
            keys[i][KEY_BYTES - 1] ^= 0x80;
        }
        char hex[2 * KEY_BYTES + 1];
        for (int b = 0; b < KEY_BYTES; b++)
            snprintf(hex + 2 * b, 3, "%02x", keys[i][b]);
        snprintf(names[i], sizeof names[i], "%.2s/%s.blk", hex, hex);
        snprintf(tmps[i], sizeof tmps[i], "%.2s/.%s.blk.%d-%zu.tmp", hex, hex, (int)getpid(), i);
    }
    src_slots = RING_BYTES / bs ? RING_BYTES / bs : 1;
    if (src_slots > n)
        src_slots = n;
    src = map_pages(src_slots * bs);
    for (size_t w = 0; w < src_slots * bs / 8; w++)
        put_le(src + 8 * w, splitmix(&state), 8);
    if (layout == SLAB || layout == SLAB_DIRECT) {
        slot_size = bs + PAGE;
        slots_per_slab = (n + (size_t)nslabs - 1) / (size_t)nslabs;
        int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
        if (layout == SLAB_DIRECT)
            flags |= O_DIRECT;
        for (int s = 0; s < nslabs; s++) {
            char name[32];
            snprintf(name, sizeof name, "slab-%03d", s);
            slab_fd[s] = openat(dir_fd, name, flags, 0600);
            if (slab_fd[s] < 0)
                fail(layout == SLAB_DIRECT ? "open slab O_DIRECT" : "open slab");
            int err = posix_fallocate(slab_fd[s], 0, (off_t)(slots_per_slab * slot_size));
            if (err) {
                errno = err;
                fail("posix_fallocate");
            }
        }
    } else {
        for (int d = 0; d < 256; d++) {
            char fan[8];
            snprintf(fan, sizeof fan, "%02x", d);
            if (mkdirat(dir_fd, fan, 0700) != 0)
                fail("mkdir fan-out");
        }
    }
    syncfs(dir_fd); /* the setup (and an earlier run's deletes) on the disk before timing */
}

static void cleanup(void) {
    if (layout == SLAB || layout == SLAB_DIRECT) {
        for (int s = 0; s < nslabs; s++) {
            char name[32];
            snprintf(name, sizeof name, "slab-%03d", s);
            close(slab_fd[s]);
            unlinkat(dir_fd, name, 0);
        }
    } else {
        for (size_t i = 0; i < 2 * n; i++) {
            if (layout == RAW) {
                char path[4096];
                raw_path(path, sizeof path, i % n, i / n);
                unlink(path);
            } else {
                unlinkat(dir_fd, names[i], 0);
                unlinkat(dir_fd, tmps[i], 0);
            }
        }
        for (int d = 0; d < 256; d++) {
            char fan[8];
            snprintf(fan, sizeof fan, "%02x", d);
            if (unlinkat(dir_fd, fan, AT_REMOVEDIR) != 0)
                perror("rmdir fan-out (not empty?)");
        }
    }
    close(dir_fd);
    if (rmdir(dir) != 0)
        perror("rmdir");
}

static int parse_phase(const char *word) {
    static const char *words[] = {"write", "rewrite", "flush", "read", "cold", "scan"};
    for (int p = 0; p < 6; p++)
        if (strcmp(word, words[p]) == 0)
            return p;
    fprintf(stderr, "unknown phase %s\n", word);
    exit(2);
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: nvme_layouts LAYOUT DIR BLOCK_BYTES BLOCKS THREADS "
                        "PHASES [--fsync] [--qd N] [--slabs N] [--verify] [--keep]\n");
        return 2;
    }
    layout = -1;
    for (int l = 0; l < NLAYOUTS; l++)
        if (strcmp(argv[1], LAYOUT_NAMES[l]) == 0)
            layout = l;
    if (layout < 0) {
        fprintf(stderr, "unknown layout %s\n", argv[1]);
        return 2;
    }
    dir = argv[2];
    bs = strtoull(argv[3], NULL, 0);
    n = strtoull(argv[4], NULL, 0);
    nthreads = atoi(argv[5]);
    if (bs == 0 || bs % PAGE || n == 0 || n >= (1u << 23) || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr, "BLOCK_BYTES: a multiple of 4096; 0 < BLOCKS < 2^23; 1 <= THREADS <= 16\n");
        return 2;
    }
    for (int a = 7; a < argc; a++) {
        if (strcmp(argv[a], "--fsync") == 0)
            fsync_on = 1;
        else if (strcmp(argv[a], "--verify") == 0)
            verify = 1;
        else if (strcmp(argv[a], "--keep") == 0)
            keep = 1;
        else if (strcmp(argv[a], "--qd") == 0 && a + 1 < argc)
            qd = atoi(argv[++a]);
        else if (strcmp(argv[a], "--slabs") == 0 && a + 1 < argc)
            nslabs = atoi(argv[++a]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[a]);
            return 2;
        }
    }
    if (qd != 1 && qd != GROUP)
        qd = GROUP; /* AIO batches are the read groups */
    if (nslabs < 1 || nslabs > MAX_SLABS)
        nslabs = 4;
    setup();
    Ctx ctxs[MAX_THREADS];
    for (int k = 0; k < nthreads; k++) {
        Ctx *c = &ctxs[k];
        memset(c, 0, sizeof *c);
        c->dst_slots = RING_BYTES / bs ? RING_BYTES / bs : 1;
        if (c->dst_slots > n)
            c->dst_slots = n;
        c->dst = map_pages(c->dst_slots * bs);
        memset(c->dst, 0, c->dst_slots * bs); /* faulted in before any timing */
        c->hdr = map_pages((size_t)GROUP * PAGE);
        memset(c->hdr, 0, (size_t)GROUP * PAGE);
        if (layout == SLAB_DIRECT && qd > 1 && syscall(SYS_io_setup, GROUP, &c->aio) != 0)
            fail("io_setup");
    }
    char *phases = strdup(argv[6]), *save = NULL;
    for (char *word = strtok_r(phases, ",", &save); word; word = strtok_r(NULL, ",", &save)) {
        phase = parse_phase(word);
        run_phase(ctxs, word);
    }
    for (int k = 0; k < nthreads; k++)
        if (ctxs[k].aio)
            syscall(SYS_io_destroy, ctxs[k].aio);
    if (!keep)
        cleanup();
    return atomic_load(&errors) ? 1 : 0;
}
