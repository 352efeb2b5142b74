/* _batchio: the nvme tier's block files, a whole batch per call, in C.
 *
 * What `blockfile.write_block` and `blockfile.read_blocks` do per block in Python, done
 * for a whole batch with the GIL released, spread over a few pthreads: the Python path
 * spent ~73 us of CPU per 64 KiB block (the interpreter around a handful of system
 * calls, the checksum, the frame), where the system calls themselves cost a few.
 *
 * The frame is `tierkv.contract.framing.Framer`'s, byte for byte:
 *     magic "TKVB" | version u16 | flags u16 | namespace hash u64 | payload length u64
 *     | payload checksum u64 (xxh3_64) | key length u16 | key
 *     | [MAC key id, 8 bytes | MAC, 32 bytes] | payload
 * (little-endian). The key id and MAC are there when the tier signs (`mac_key_env`):
 * the MAC is the keyed BLAKE3 of everything before it and of the payload
 * (`tierkv.contract.mac`), made and checked here (`_blake3.c`) as the checksum is.
 *
 * Python (`native.py`) resolves every block's fan-out directory descriptor (`Leaves`,
 * which owns the O_NOFOLLOW checks of directories) and names; this module only opens,
 * reads, writes, renames and deletes relative to those descriptors, never by path, and
 * never follows a link (O_NOFOLLOW on every open, renameat replaces the name itself).
 *
 * Outcome per block: 0 ok, -errno for a system call that failed, or a positive
 * CORRUPT_* code for a frame that fails a check (the file is then deleted if its name
 * still holds it, as `blockfile._discard_corrupt` does).
 *
 * Every call takes an optional deadline (CLOCK_MONOTONIC seconds, Python's
 * time.monotonic(); 0: none): a block not started by then is not touched and answers
 * -ECANCELED. A job past its deadline thus stops within one block per thread, so its
 * call does not go on reading into (or copying out of) memory its caller may have
 * handed back: an engine's page, answered as a miss at the deadline.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_blake3.h"
#include "_xxh3.h"
#if __has_include(<linux/openat2.h>)
#include <linux/openat2.h>
#endif

#define FIXED_HEADER_BYTES 34
#define FORMAT_VERSION 1
#define MAX_KEY_BYTES 65535
#define MAX_THREADS 16
#define PREFETCH_BLOCKS 16   /* blockfile.PREFETCH_BLOCKS */
#define SHORT_DISTANCE 64    /* blockfile.SHORT_DISTANCE */
#define SCRATCH_MAX_BYTES (256 << 10) /* blockfile.SCRATCH_MAX_BYTES */
#define PAGE 4096
#define FLAG_MAC 0x0001    /* framing.FLAG_MAC */
#define FLAG_KEY_ID 0x0002 /* framing.FLAG_KEY_ID */
#define KEY_ID_BYTES 8
#define MAC_BYTES TKV_BLAKE3_OUT_BYTES
#define SIG_BYTES (KEY_ID_BYTES + MAC_BYTES) /* what a signed frame adds after its key */

/* Frame check failures, one per kind (`native.CORRUPT_KINDS` names them). */
enum {
    CORRUPT_SHORT = 1,     /* the file ended before the frame did */
    CORRUPT_LONG = 2,      /* the file is longer than the frame */
    CORRUPT_MAGIC = 3,
    CORRUPT_VERSION = 4,
    CORRUPT_FLAGS = 5,
    CORRUPT_NAMESPACE = 6,
    CORRUPT_KEY_LENGTH = 7,
    CORRUPT_KEY = 8,
    CORRUPT_PAYLOAD_LENGTH = 9,
    CORRUPT_CHECKSUM = 10,
    CORRUPT_SLOT = 11,     /* a slab slot's own header fails (never written, torn, freed) */
    CORRUPT_MAC = 12,      /* the MAC does not check (altered, or written without the key) */
};
#define NOT_CACHED 100 /* internal: a RWF_NOWAIT read that decided nothing */

static const unsigned char MAGIC[4] = {'T', 'K', 'V', 'B'};

/* Read flags, process-wide as in blockfile._ReadFlags: O_NOATIME until a file refuses
 * it (EPERM: not our file), then without for good. RWF_NOWAIT likewise (_Cached). */
static atomic_int read_noatime = 1;
static atomic_int nowait_works = 1;

/* One block of a batch. */
typedef struct {
    int dir_fd;
    const char *name;      /* final file name in dir_fd ("ab/<hex>.blk" when beneath) */
    int beneath;           /* name is a path below dir_fd: opened by openat2, no links */
    const char *tmp;       /* temporary name (writes) */
    const unsigned char *key;
    size_t key_len;
    struct iovec *regions; /* payload, in order (into the batch's iovec array) */
    int nregions;
    size_t payload_len;
    int touch;             /* reads: refresh the mtime once read and checked */
    unsigned char *head;   /* header: built (writes) or read (reads); head_bytes long */
    long code;             /* outcome */
    ssize_t got;           /* reads: bytes the file gave (for CORRUPT_SHORT/LONG) */
    int fd;                /* slab calls: the slab file of the block's slot */
    off_t offset;          /* slab calls: where the block's slot starts in it */
    uint64_t seq;          /* slab calls: the slot's write sequence (reads: 0, or touch) */
    int dfd;               /* slab calls: the slot's file opened O_DIRECT, or -1 (buffered) */
} Item;

/* What every frame of a call shares: its namespace, and the MAC key when it signs. */
typedef struct {
    uint64_t ns_hash;
    int mac;               /* frames carry a key id and a MAC (a Framer with a key) */
    uint8_t key[TKV_BLAKE3_KEY_BYTES];
    uint8_t key_id[KEY_ID_BYTES];
} Frame;

/* Bytes of the frame header of a key of `key_len` bytes (Framer.header_bytes). */
static size_t head_bytes_of(const Frame *frame, size_t key_len) {
    return FIXED_HEADER_BYTES + key_len + (frame->mac ? SIG_BYTES : 0);
}

typedef struct {
    Item *items;
    size_t n;
    atomic_size_t next;    /* the next block (writes) or group (reads) to take */
    Frame frame;
    int fsync;
    size_t group;          /* reads: blocks per group, PREFETCH_BLOCKS at most */
    size_t room;           /* slab calls: payload bytes of a slot (a PAGE multiple) */
    double deadline;       /* CLOCK_MONOTONIC seconds; 0: none (a block not started by
                            * then answers -ECANCELED, untouched) */
} Batch;

/* Whether `batch`'s deadline has passed: checked before each block (a vDSO clock read,
 * tens of nanoseconds). */
static int past_deadline(const Batch *batch) {
    if (batch->deadline <= 0)
        return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9 >= batch->deadline;
}

/* -- the frame ------------------------------------------------------------------- */

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

/* The MAC of `item`'s frame: keyed BLAKE3 of its first `signed_len` header bytes and
 * its payload (MacKey.tag(fixed, key, key id, *payload)), into `out`. 0 or -ENOMEM. */
static int frame_mac(const Frame *frame, const Item *item, size_t signed_len, uint8_t *out) {
    int n = item->nregions + 1;
    struct iovec local[17];
    struct iovec *parts = n <= 17 ? local : malloc(sizeof *parts * (size_t)n);
    if (parts == NULL)
        return -ENOMEM;
    parts[0].iov_base = item->head;
    parts[0].iov_len = signed_len;
    memcpy(parts + 1, item->regions, sizeof *parts * (size_t)item->nregions);
    tkv_blake3_keyed(frame->key, parts, n, out);
    if (parts != local)
        free(parts);
    return 0;
}

/* The header of `item`'s frame into item->head (Framer.encode_header): signed (key id
 * and MAC after the key) when the call's frames are. */
static int build_header(const Batch *batch, Item *item) {
    uint64_t sum = tkv_xxh3_64_parts(item->regions, item->nregions);
    const Frame *frame = &batch->frame;
    unsigned char *h = item->head;
    memcpy(h, MAGIC, 4);
    put_le(h + 4, FORMAT_VERSION, 2);
    put_le(h + 6, frame->mac ? FLAG_MAC | FLAG_KEY_ID : 0, 2);
    put_le(h + 8, frame->ns_hash, 8);
    put_le(h + 16, item->payload_len, 8);
    put_le(h + 24, sum, 8);
    put_le(h + 32, item->key_len, 2);
    memcpy(h + FIXED_HEADER_BYTES, item->key, item->key_len);
    if (!frame->mac)
        return 0;
    size_t signed_len = FIXED_HEADER_BYTES + item->key_len + KEY_ID_BYTES;
    memcpy(h + FIXED_HEADER_BYTES + item->key_len, frame->key_id, KEY_ID_BYTES);
    return frame_mac(frame, item, signed_len, h + signed_len);
}

/* Whether two MACs are equal, in time independent of where they differ. */
static int same_mac(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0;
    for (int i = 0; i < MAC_BYTES; i++)
        diff |= a[i] ^ b[i];
    return diff == 0;
}

/* Every field of the header read for `item`, in the order Framer.check_frame reports
 * them; the checksum over the payload where it now lies, then the MAC. A signing call
 * takes only frames signed with its key id (the form it writes): any other flags or
 * key id are CORRUPT_FLAGS, which the caller's Framer names precisely (`ForeignBlock`
 * for another trust domain's block). */
static long check_frame(const Batch *batch, const Item *item) {
    const Frame *frame = &batch->frame;
    const unsigned char *h = item->head;
    if (memcmp(h, MAGIC, 4) != 0)
        return CORRUPT_MAGIC;
    if (get_le(h + 4, 2) != FORMAT_VERSION)
        return CORRUPT_VERSION;
    if (get_le(h + 6, 2) != (frame->mac ? FLAG_MAC | FLAG_KEY_ID : 0))
        return CORRUPT_FLAGS;
    if (get_le(h + 8, 8) != frame->ns_hash)
        return CORRUPT_NAMESPACE;
    if (get_le(h + 32, 2) != item->key_len)
        return CORRUPT_KEY_LENGTH;
    if (memcmp(h + FIXED_HEADER_BYTES, item->key, item->key_len) != 0)
        return CORRUPT_KEY;
    size_t signed_len = FIXED_HEADER_BYTES + item->key_len + KEY_ID_BYTES;
    if (frame->mac && memcmp(h + FIXED_HEADER_BYTES + item->key_len, frame->key_id,
                             KEY_ID_BYTES) != 0)
        return CORRUPT_FLAGS;
    if (get_le(h + 16, 8) != item->payload_len)
        return CORRUPT_PAYLOAD_LENGTH;
    if (frame->mac) {
        /* A MAC that checks vouches for every byte its writer signed, the checksum
         * field and the payload with it: the checksum pass is needed only to name
         * what failed (the checksum first, as Framer.verify reports it). */
        uint8_t mac[MAC_BYTES];
        int err = frame_mac(frame, item, signed_len, mac);
        if (err)
            return err;
        if (same_mac(mac, h + signed_len))
            return 0;
    }
    if (get_le(h + 24, 8) != tkv_xxh3_64_parts(item->regions, item->nregions))
        return CORRUPT_CHECKSUM;
    return frame->mac ? CORRUPT_MAC : 0;
}

/* -- vectored I/O to the end ------------------------------------------------------ */

/* Skip `done` bytes of iov[0..*n), adjusting the first remaining entry in place. */
static struct iovec *advance(struct iovec *iov, int *n, size_t done) {
    while (*n && done >= iov->iov_len) {
        done -= iov->iov_len;
        iov++;
        (*n)--;
    }
    if (*n) {
        iov->iov_base = (char *)iov->iov_base + done;
        iov->iov_len -= done;
    }
    return iov;
}

/* pwritev all of iov (consumed) at `offset`, continuing after short writes. */
static int write_all_at(int fd, struct iovec *iov, int n, off_t offset) {
    while (n) {
        ssize_t put = pwritev(fd, iov, n < IOV_MAX ? n : IOV_MAX, offset);
        if (put < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (put == 0)
            return -EIO; /* "write made no progress", as blockfile._write_all */
        offset += put;
        iov = advance(iov, &n, (size_t)put);
    }
    return 0;
}

static int write_all(int fd, struct iovec *iov, int n) {
    return write_all_at(fd, iov, n, 0);
}

/* preadv into iov (consumed) from `offset` until full or end of file; bytes read
 * (from `offset`) or -errno. `flags` as preadv2's (RWF_NOWAIT: one call only). */
static ssize_t read_all(int fd, struct iovec *iov, int n, off_t offset, int flags) {
    ssize_t total = 0;
    while (n) {
        ssize_t got = preadv2(fd, iov, n < IOV_MAX ? n : IOV_MAX, offset + total, flags);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            break;
        total += got;
        iov = advance(iov, &n, (size_t)got);
        if (flags)
            break; /* a cache-only read decides from its one call */
    }
    return total;
}

/* -- opening below the tier's directory --------------------------------------------- */

/* openat2's RESOLVE_* flags: no symbolic link in any component, nothing outside dir_fd
 * (the batch calls name "ab/<hex>.blk" below the namespace directory, so each file is
 * opened without following a link in its fan-out directory either). 0 (openat, the name
 * is a single component) once the kernel says it lacks openat2: the Python side then
 * hands the per-item calls directory descriptors instead (`beneath_works`). */
#if defined(SYS_openat2) && defined(RESOLVE_NO_SYMLINKS)
#define HAVE_OPENAT2 1
#else
#define HAVE_OPENAT2 0
#endif
static atomic_int openat2_works = HAVE_OPENAT2;

/* open `name` in `dir_fd` without following a link: openat2 below dir_fd when
 * `beneath`, else openat with O_NOFOLLOW (a single component). -errno on failure. */
static int open_in(int dir_fd, const char *name, int beneath, int flags, mode_t mode) {
    int fd;
#if HAVE_OPENAT2
    if (beneath) {
        struct open_how how;
        memset(&how, 0, sizeof how);
        how.flags = (uint64_t)(flags & ~O_NOFOLLOW) | O_CLOEXEC;
        how.mode = (flags & O_CREAT) ? mode : 0;
        how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH;
        fd = (int)syscall(SYS_openat2, dir_fd, name, &how, sizeof how);
        if (fd < 0 && errno == ENOSYS)
            atomic_store(&openat2_works, 0);
        return fd < 0 ? -errno : fd;
    }
#else
    if (beneath)
        return -ENOSYS;
#endif
    fd = openat(dir_fd, name, flags | O_NOFOLLOW | O_CLOEXEC, mode);
    return fd < 0 ? -errno : fd;
}

/* The fan-out directory of a beneath `name` ("ab/..."), made 0700 if missing (mkdirat
 * does not follow a link at its name: a link there reads EEXIST, and the next openat2
 * refuses it). */
static void make_fanout(int dir_fd, const char *name) {
    const char *slash = strchr(name, '/');
    if (slash == NULL || slash - name >= 16)
        return;
    char fan[16];
    memcpy(fan, name, (size_t)(slash - name));
    fan[slash - name] = 0;
    mkdirat(dir_fd, fan, 0700);
}

/* -- writes ----------------------------------------------------------------------- */

/* Create `path` (in item->dir_fd, O_EXCL, 0600), making a new fan-out directory of a
 * batch call's item on the way. The descriptor or -errno. */
static int create_file(const Item *item, const char *path) {
    int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = open_in(item->dir_fd, path, item->beneath, flags, 0600);
    if (fd == -ENOENT && item->beneath) { /* its fan-out directory is new */
        make_fanout(item->dir_fd, item->name);
        fd = open_in(item->dir_fd, path, item->beneath, flags, 0600);
    }
    return fd;
}

/* Header + regions into the new file `fd`, fdatasync'ed when asked, closed. 0 or -errno. */
static long fill_file(const Batch *batch, const Item *item, int fd) {
    long err;
    /* write_all consumes the array, so a copy on the stack when small */
    int n = item->nregions + 1;
    struct iovec local[16];
    struct iovec *iov = n <= 16 ? local : malloc(sizeof *iov * (size_t)n);
    if (iov == NULL) {
        err = -ENOMEM;
    } else {
        iov[0].iov_base = item->head;
        iov[0].iov_len = head_bytes_of(&batch->frame, item->key_len);
        memcpy(iov + 1, item->regions, sizeof *iov * (size_t)item->nregions);
        err = write_all(fd, iov, n);
        if (iov != local)
            free(iov);
    }
    if (!err && batch->fsync && fdatasync(fd) != 0)
        err = -errno;
    if (close(fd) != 0 && !err && errno != EINTR)
        err = -errno;
    return err;
}

/* blockfile.write_block for one block: temp file, header + payload, fdatasync, rename
 * onto the final name; the temp file is deleted on any failure.
 *
 * A batch call's block whose final name is free is written there directly (O_EXCL:
 * created by this call, so deleted by it on failure), saving a rename per block (~5 us
 * of ~19 for a 16 KiB block on tmpfs). The same promises hold: the index learns of a
 * block only once its write returned, so no load reads a file being written; a process
 * killed mid-write leaves a file shorter than its frame, which the next open's scan
 * deletes (`recovery.py`: size must be header + payload), and bytes lost by a power
 * failure fail the length or checksum check on load, a miss. A name already taken (a
 * file the index does not hold) is replaced by rename, as on the per-block calls. */
static long write_one(const Batch *batch, Item *item) {
    long err = build_header(batch, item);
    if (err)
        return err;
    if (item->beneath) {
        int fd = create_file(item, item->name);
        if (fd >= 0) {
            err = fill_file(batch, item, fd);
            if (err)
                unlinkat(item->dir_fd, item->name, 0);
            return err;
        }
        if (fd != -EEXIST)
            return fd;
    }
    int fd = create_file(item, item->tmp);
    if (fd < 0)
        return fd;
    err = fill_file(batch, item, fd);
    /* renameat never follows a link at the target: it replaces the name itself */
    if (!err && renameat(item->dir_fd, item->tmp, item->dir_fd, item->name) != 0)
        err = -errno;
    if (err)
        unlinkat(item->dir_fd, item->tmp, 0);
    return err;
}

static void *write_worker(void *arg) {
    Batch *batch = arg;
    size_t i;
    while ((i = atomic_fetch_add(&batch->next, 1)) < batch->n)
        batch->items[i].code = past_deadline(batch) ? -ECANCELED : write_one(batch, &batch->items[i]);
    return NULL;
}

/* -- reads ------------------------------------------------------------------------ */

/* Per thread: a page-aligned buffer frames at a short distance are read through
 * (blockfile._Scratch), mapped on first need, and the spare byte every read ends in. */
typedef struct {
    unsigned char *map;
    size_t size;
    unsigned char spare;
} Scratch;

static void scratch_close(Scratch *s) {
    if (s->map)
        munmap(s->map, s->size);
    s->map = NULL;
    s->size = 0;
}

/* Where to read `item`'s frame (header, payload, spare byte) when copying it straight
 * into the regions would be slow (a region 1..SHORT_DISTANCE-1 bytes past its payload's
 * file offset, modulo a page: blockfile.SHORT_DISTANCE), placed as _Scratch._place
 * does so that neither the kernel's copy nor ours is short; NULL to read straight in. */
static unsigned char *scratch_frame(Scratch *s, const Item *item, size_t head_bytes) {
    if (item->payload_len > SCRATCH_MAX_BYTES || item->nregions == 0)
        return NULL;
    size_t offset = head_bytes, first = 0;
    int is_short = 0;
    for (int i = 0; i < item->nregions; i++) {
        size_t here = ((uintptr_t)item->regions[i].iov_base - offset) % PAGE;
        if (i == 0)
            first = here;
        is_short |= here > 0 && here < SHORT_DISTANCE;
        offset += item->regions[i].iov_len;
    }
    if (!is_short)
        return NULL;
    size_t start = SHORT_DISTANCE + first;
    size_t size = start + head_bytes + item->payload_len + 1;
    if (s->size < size) {
        scratch_close(s);
        size_t rounded = (size + PAGE - 1) / PAGE * PAGE;
        void *map = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED)
            return NULL; /* read straight in: slow, not wrong */
        s->map = map;
        s->size = rounded;
    }
    return s->map + start;
}

/* A read-only descriptor of `item`'s file, opened without following a link (nor
 * updating its access time while files allow it). */
static int open_block(const Item *item) {
    int base = O_RDONLY | O_NOFOLLOW | O_CLOEXEC;
    if (atomic_load(&read_noatime)) {
        int fd = open_in(item->dir_fd, item->name, item->beneath, base | O_NOATIME, 0);
        if (fd != -EPERM)
            return fd;
        atomic_store(&read_noatime, 0); /* not our files: read as anyone may */
    }
    return open_in(item->dir_fd, item->name, item->beneath, base, 0);
}

/* Delete `item`'s file if its name still holds the file open as `fd`: a corrupt file
 * goes, never a good block that replaced it meanwhile (blockfile._discard_if_same). */
static void discard_if_same(const Item *item, int fd) {
    struct stat opened, current;
    if (fstat(fd, &opened) != 0)
        return;
    if (fstatat(item->dir_fd, item->name, &current, AT_SYMLINK_NOFOLLOW) != 0)
        return;
    if (opened.st_dev == current.st_dev && opened.st_ino == current.st_ino)
        unlinkat(item->dir_fd, item->name, 0);
}

/* blockfile.read_opened for one block open as `fd`: header, payload straight into the
 * regions (or through scratch) and a spare byte in one preadv, then the length and every
 * header field and the checksum. With `nowait`, the page cache only: NOT_CACHED when
 * that decides nothing (then nothing is decided and the caller reads again without). */
static long read_one(const Batch *batch, Item *item, int fd, Scratch *s, int nowait) {
    size_t head_bytes = head_bytes_of(&batch->frame, item->key_len);
    size_t expected = head_bytes + item->payload_len;
    unsigned char *frame = scratch_frame(s, item, head_bytes);
    int n = frame ? 1 : item->nregions + 2;
    struct iovec local[18];
    struct iovec *iov = n <= 18 ? local : malloc(sizeof *iov * (size_t)n);
    if (iov == NULL)
        return -ENOMEM;
    if (frame) {
        iov[0].iov_base = frame;
        iov[0].iov_len = expected + 1;
    } else {
        iov[0].iov_base = item->head;
        iov[0].iov_len = head_bytes;
        memcpy(iov + 1, item->regions, sizeof *iov * (size_t)item->nregions);
        iov[n - 1].iov_base = &s->spare;
        iov[n - 1].iov_len = 1;
    }
    ssize_t got;
    if (nowait) {
        got = read_all(fd, iov, n, 0, RWF_NOWAIT);
        if (got == -EAGAIN) {
            got = NOT_CACHED;
        } else if (got == -EOPNOTSUPP || got == -EINVAL || got == -ENOSYS) {
            atomic_store(&nowait_works, 0);
            got = NOT_CACHED;
        } else if (got >= 0 && ((size_t)got < expected ||
                                ((size_t)got == expected && expected % PAGE == 0))) {
            got = NOT_CACHED; /* not all there, or its length not decided by a read page */
        }
        if (got == NOT_CACHED) {
            if (iov != local)
                free(iov);
            return NOT_CACHED;
        }
    } else {
        got = read_all(fd, iov, n, 0, 0);
    }
    if (iov != local)
        free(iov);
    if (got < 0)
        return (long)got;
    item->got = got;
    long code = 0;
    if ((size_t)got != expected) {
        code = (size_t)got > expected ? CORRUPT_LONG : CORRUPT_SHORT;
    } else {
        if (frame) { /* header out of scratch, payload into the regions in order */
            memcpy(item->head, frame, head_bytes);
            const unsigned char *from = frame + head_bytes;
            for (int i = 0; i < item->nregions; i++) {
                memcpy(item->regions[i].iov_base, from, item->regions[i].iov_len);
                from += item->regions[i].iov_len;
            }
        }
        code = check_frame(batch, item);
    }
    if (code > 0) {
        discard_if_same(item, fd);
        return code;
    }
    if (code == 0 && item->touch && futimens(fd, NULL) != 0)
        return -errno;
    return code;
}

/* blockfile._read_groups for one group of PREFETCH_BLOCKS blocks: open each, read it
 * at once if the page cache holds it whole; from the first it does not, advise the rest
 * together (POSIX_FADV_WILLNEED) and read them, so the disk works on all at once. */
static void read_group(const Batch *batch, size_t first, size_t end, Scratch *s) {
    int fds[PREFETCH_BLOCKS];
    size_t cold[PREFETCH_BLOCKS];
    size_t ncold = 0;
    int cached = atomic_load(&nowait_works);
    for (size_t i = first; i < end; i++) {
        Item *item = &batch->items[i];
        if (past_deadline(batch)) {
            fds[i - first] = -1;
            item->code = -ECANCELED;
            continue;
        }
        int fd = fds[i - first] = open_block(item);
        if (fd < 0) {
            item->code = fd;
            continue;
        }
        long code = cached ? read_one(batch, item, fd, s, 1) : NOT_CACHED;
        if (code == NOT_CACHED) {
            cold[ncold++] = i;
            cached = 0; /* the rest is likely cold too: advised and read with it */
        } else {
            item->code = code;
        }
    }
    if (ncold > 1)
        for (size_t c = 0; c < ncold; c++)
            posix_fadvise(fds[cold[c] - first], 0, 0, POSIX_FADV_WILLNEED);
    for (size_t c = 0; c < ncold; c++) {
        Item *item = &batch->items[cold[c]];
        item->code = past_deadline(batch) ? -ECANCELED : read_one(batch, item, fds[cold[c] - first], s, 0);
    }
    for (size_t i = first; i < end; i++)
        if (fds[i - first] >= 0)
            close(fds[i - first]);
}

static void *read_worker(void *arg) {
    Batch *batch = arg;
    Scratch scratch = {NULL, 0, 0};
    size_t group;
    while ((group = atomic_fetch_add(&batch->next, 1)) * batch->group < batch->n) {
        size_t first = group * batch->group;
        size_t end = first + batch->group < batch->n ? first + batch->group : batch->n;
        read_group(batch, first, end, &scratch);
    }
    scratch_close(&scratch);
    return NULL;
}

/* Run `worker` on `threads` threads (this one among them); GIL released by the caller.
 * A thread that cannot be started leaves its share to the others. */
static void run_threads(void *(*worker)(void *), Batch *batch, int threads) {
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&ids[started], NULL, worker, batch) == 0)
            started++;
    worker(batch);
    for (int t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
}

/* -- from Python ------------------------------------------------------------------ */

/* PyArg "O&" converter for a call's frames: the namespace hash (an int: unsigned
 * frames), or (namespace hash, MAC key: 32 bytes, key id: 8 bytes) for signed ones
 * (`native._frame`: the Framer's MacKey, derived, never the secret itself). */
static int frame_arg(PyObject *obj, void *out) {
    Frame *frame = out;
    memset(frame, 0, sizeof *frame);
    PyObject *tag = obj, *key = NULL, *key_id = NULL;
    if (PyTuple_Check(obj)) {
        if (!PyArg_ParseTuple(obj, "OSS", &tag, &key, &key_id))
            return 0;
        if (PyBytes_GET_SIZE(key) != TKV_BLAKE3_KEY_BYTES ||
            PyBytes_GET_SIZE(key_id) != KEY_ID_BYTES) {
            PyErr_Format(PyExc_ValueError, "frame: (ns_hash, key of %d bytes, key id of %d)",
                         TKV_BLAKE3_KEY_BYTES, KEY_ID_BYTES);
            return 0;
        }
        frame->mac = 1;
        memcpy(frame->key, PyBytes_AS_STRING(key), TKV_BLAKE3_KEY_BYTES);
        memcpy(frame->key_id, PyBytes_AS_STRING(key_id), KEY_ID_BYTES);
    }
    frame->ns_hash = PyLong_AsUnsignedLongLongMask(tag);
    return !(frame->ns_hash == (uint64_t)-1 && PyErr_Occurred());
}

/* Everything a call holds while the GIL is released: items, their iovecs and headers,
 * and the Py_buffers that keep the payload memory alive. */
typedef struct {
    Item *items;
    struct iovec *iovs;
    Py_buffer *views;
    Py_ssize_t nviews;
    unsigned char *heads;
    char *names;           /* batch calls: each block's "ab/<hex>.blk" and temp name */
    int aligned;           /* slab calls: 1 every block's memory may take O_DIRECT (the
                            * lanes' geometry), 0 none, -1 decided per block (items) */
} Held;

static void held_release(Held *held) {
    for (Py_ssize_t i = 0; i < held->nviews; i++)
        PyBuffer_Release(&held->views[i]);
    PyMem_Free(held->items);
    PyMem_Free(held->iovs);
    PyMem_Free(held->views);
    PyMem_Free(held->heads);
    PyMem_Free(held->names);
}

/* Regions of a slot: one buffer, or a tuple of buffers (blockfile.Slot). */
static Py_ssize_t count_regions(PyObject *slot) {
    return PyTuple_Check(slot) ? PyTuple_GET_SIZE(slot) : 1;
}

/* O_DIRECT's rule here: memory at `base`, then every `stride` bytes, `size` bytes long,
 * may be moved by O_DIRECT when all three are multiples of PAGE. The kernel asks less
 * of most devices (the logical block, often 512 bytes), but 4 KiB holds on every
 * device and filesystem we meet, and a read of whole pages must never write past the
 * block's memory (a read's length is the payload's, rounded up to nothing). */
static int region_aligned(const void *base, Py_ssize_t stride, Py_ssize_t size) {
    return (((uintptr_t)base | (size_t)stride | (size_t)size) % PAGE) == 0;
}

/* Whether every region of `item` may be moved by O_DIRECT (region_aligned each). */
static int item_aligned(const Item *item) {
    for (int r = 0; r < item->nregions; r++)
        if (!region_aligned(item->regions[r].iov_base, 0, (Py_ssize_t)item->regions[r].iov_len))
            return 0;
    return 1;
}

/* Take the buffers of `slot` (writable for reads) into item->regions. */
static int take_regions(Held *held, Item *item, PyObject *slot, int writable) {
    Py_ssize_t n = count_regions(slot);
    item->payload_len = 0;
    item->nregions = (int)n;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *region = PyTuple_Check(slot) ? PyTuple_GET_ITEM(slot, r) : slot;
        Py_buffer *view = &held->views[held->nviews];
        if (PyObject_GetBuffer(region, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0)
            return -1;
        held->nviews++;
        item->regions[r].iov_base = view->buf;
        item->regions[r].iov_len = (size_t)view->len;
        item->payload_len += (size_t)view->len;
    }
    return 0;
}

/* Parse `items` (a list of tuples: dir_fd, name, [tmp,] key, slot[, touch]) into
 * held->items; with the GIL held. */
static int parse_items(PyObject *items, Held *held, int reads) {
    Py_ssize_t n = PyList_GET_SIZE(items), nregions = 0, nhead = 0;
    Py_ssize_t width = 5; /* (dir_fd, name, tmp|key, key|slot, slot|touch) */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != width) {
            PyErr_Format(PyExc_TypeError, "item %zd: a tuple of %zd fields expected", i, width);
            return -1;
        }
        PyObject *key = PyTuple_GET_ITEM(t, reads ? 2 : 3);
        PyObject *slot = PyTuple_GET_ITEM(t, reads ? 3 : 4);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > MAX_KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "item %zd: key must be bytes of at most %d", i,
                         MAX_KEY_BYTES);
            return -1;
        }
        nregions += count_regions(slot);
        nhead += FIXED_HEADER_BYTES + PyBytes_GET_SIZE(key) + SIG_BYTES;
    }
    held->aligned = -1; /* lent buffers: each block's own */
    held->items = PyMem_Calloc((size_t)n + 1, sizeof(Item));
    held->iovs = PyMem_Calloc((size_t)nregions + 1, sizeof(struct iovec));
    held->views = PyMem_Calloc((size_t)nregions + 1, sizeof(Py_buffer));
    held->heads = PyMem_Malloc((size_t)nhead + 1);
    if (!held->items || !held->iovs || !held->views || !held->heads) {
        PyErr_NoMemory();
        return -1;
    }
    struct iovec *iov = held->iovs;
    unsigned char *head = held->heads;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(items, i);
        Item *item = &held->items[i];
        item->dir_fd = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
        if (item->dir_fd == -1 && PyErr_Occurred())
            return -1;
        item->name = PyBytes_AsString(PyTuple_GET_ITEM(t, 1));
        if (item->name == NULL)
            return -1;
        if (!reads && (item->tmp = PyBytes_AsString(PyTuple_GET_ITEM(t, 2))) == NULL)
            return -1;
        PyObject *key = PyTuple_GET_ITEM(t, reads ? 2 : 3);
        item->key = (const unsigned char *)PyBytes_AS_STRING(key);
        item->key_len = (size_t)PyBytes_GET_SIZE(key);
        item->regions = iov;
        if (take_regions(held, item, PyTuple_GET_ITEM(t, reads ? 3 : 4), reads) != 0)
            return -1;
        iov += item->nregions;
        item->touch = reads ? PyObject_IsTrue(PyTuple_GET_ITEM(t, 4)) : 0;
        if (item->touch < 0)
            return -1;
        item->head = head;
        head += FIXED_HEADER_BYTES + item->key_len + SIG_BYTES;
    }
    return 0;
}


/* -- batch calls: keys, lanes and slots, no per-block Python ------------------------ */

#define MAX_HEX_KEY_BYTES 100 /* layout.MAX_HEX_KEY_BYTES: longer keys are named by sha256 */
#define HEAD_STRIDE (FIXED_HEADER_BYTES + MAX_HEX_KEY_BYTES + SIG_BYTES) /* a header's room */
#define NAME_BYTES 256        /* "ab/" + 200 hex + ".blk" + NUL */
#define TMP_BYTES 320         /* "ab/." + final + ".<pid>-c<n>.tmp" + NUL */
static atomic_ulong temp_ids;

/* "ab/<hex>.blk" of `key` (layout.block_relpath for keys of 1..MAX_HEX_KEY_BYTES). */
static void name_of(char *out, const unsigned char *key, size_t len) {
    static const char hex[] = "0123456789abcdef";
    char *at = out;
    *at++ = hex[key[0] >> 4];
    *at++ = hex[key[0] & 15];
    *at++ = '/';
    for (size_t i = 0; i < len; i++) {
        *at++ = hex[key[i] >> 4];
        *at++ = hex[key[i] & 15];
    }
    memcpy(at, ".blk", 5);
}

/* Parse a batch call's arguments into held->items: block i is keys[i] at slot slots[i]
 * of the lanes, (buffer, offset, stride, size) each: its regions are, lane by lane,
 * buffer[offset + slot * stride : ... + size] (tierkv.contract.slab's lanes). Every
 * region is checked to lie inside its buffer. With the GIL held. */
static int parse_batch(Held *held, int root_fd, PyObject *keys, PyObject *lanes,
                       PyObject *slots, Py_ssize_t num_blocks, PyObject *touch, int reads,
                       int named) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(slots) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd slots", n, PyList_GET_SIZE(slots));
        return -1;
    }
    Py_ssize_t nlanes = PyTuple_GET_SIZE(lanes);
    if (nlanes < 1 || nlanes > 65536) {
        PyErr_SetString(PyExc_ValueError, "lanes: between 1 and 65536 (buffer, offset, stride, size)");
        return -1;
    }
    const char *touched = NULL;
    if (touch != Py_None) {
        if (!PyBytes_Check(touch) || PyBytes_GET_SIZE(touch) != n) {
            PyErr_SetString(PyExc_ValueError, "touch: None or bytes with one flag per key");
            return -1;
        }
        touched = PyBytes_AS_STRING(touch);
    }
    held->items = PyMem_Calloc((size_t)n + 1, sizeof(Item));
    held->iovs = PyMem_Calloc((size_t)(n * nlanes) + 1, sizeof(struct iovec));
    held->views = PyMem_Calloc((size_t)nlanes, sizeof(Py_buffer));
    held->heads = PyMem_Malloc((size_t)n * HEAD_STRIDE + 1);
    held->names = PyMem_Malloc(named ? (size_t)n * (NAME_BYTES + (reads ? 0 : TMP_BYTES)) + 1 : 1);
    /* lane l: (offset, stride, size) at lane[3l..3l+2], its buffer in held->views[l] */
    Py_ssize_t *lane = PyMem_Malloc(sizeof *lane * (size_t)nlanes * 3);
    if (!held->items || !held->iovs || !held->views || !held->heads || !held->names || !lane) {
        PyMem_Free(lane);
        PyErr_NoMemory();
        return -1;
    }
    int rc = -1;
    size_t payload_len = 0;
    held->aligned = 1; /* one geometry: one answer for every block of the call */
    for (Py_ssize_t l = 0; l < nlanes; l++) {
        PyObject *t = PyTuple_GET_ITEM(lanes, l);
        PyObject *buffer;
        Py_ssize_t offset, stride, size;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "Onnn", &buffer, &offset, &stride, &size)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "lane %zd: (buffer, offset, stride, size) expected", l);
            goto done;
        }
        if (offset < 0 || stride <= 0 || size <= 0 || stride < size) {
            PyErr_Format(PyExc_ValueError, "lane %zd: offset >= 0 and stride >= size > 0 expected", l);
            goto done;
        }
        if (PyObject_GetBuffer(buffer, &held->views[l], reads ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0)
            goto done;
        held->nviews++;
        held->aligned &= region_aligned((char *)held->views[l].buf + offset, stride, size);
        lane[3 * l] = offset;
        lane[3 * l + 1] = stride;
        lane[3 * l + 2] = size;
        payload_len += (size_t)size;
    }
    pid_t pid = getpid();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 1 ||
            PyBytes_GET_SIZE(key) > MAX_HEX_KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "key %zd: bytes of 1 to %d expected", i, MAX_HEX_KEY_BYTES);
            goto done;
        }
        Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred())
            goto done;
        if (slot < 0 || slot >= num_blocks) {
            PyErr_Format(PyExc_IndexError, "slot %zd is out of range 0..%zd", slot, num_blocks - 1);
            goto done;
        }
        Item *item = &held->items[i];
        item->dir_fd = root_fd;
        item->beneath = 1;
        item->key = (const unsigned char *)PyBytes_AS_STRING(key);
        item->key_len = (size_t)PyBytes_GET_SIZE(key);
        item->regions = held->iovs + i * nlanes;
        item->nregions = (int)nlanes;
        item->payload_len = payload_len;
        for (Py_ssize_t l = 0; l < nlanes; l++) {
            Py_ssize_t offset = lane[3 * l], stride = lane[3 * l + 1], size = lane[3 * l + 2];
            Py_ssize_t len = held->views[l].len;
            /* offset + slot * stride + size <= len, without overflow */
            if (offset > len || size > len - offset || (slot && stride > (len - offset - size) / slot)) {
                PyErr_Format(PyExc_IndexError, "slot %zd: lane %zd's region lies outside its buffer "
                             "of %zd bytes", slot, l, len);
                goto done;
            }
            item->regions[l].iov_base = (char *)held->views[l].buf + offset + slot * stride;
            item->regions[l].iov_len = (size_t)size;
        }
        item->touch = touched ? touched[i] != 0 : 0;
        item->head = held->heads + i * HEAD_STRIDE;
        if (!named)
            continue; /* slab calls: the slot is the place, no name */
        char *name = held->names + i * (NAME_BYTES + (reads ? 0 : TMP_BYTES));
        name_of(name, item->key, item->key_len);
        item->name = name;
        if (!reads) {
            /* "ab/.<hex>.blk.<pid>-c<n>.tmp" (layout.temp_name's form, "c": the core's ids) */
            char *tmp = name + NAME_BYTES;
            size_t final_len = strlen(name + 3);
            memcpy(tmp, name, 3);
            tmp[3] = '.';
            memcpy(tmp + 4, name + 3, final_len);
            snprintf(tmp + 4 + final_len, TMP_BYTES - 4 - final_len, ".%ld-c%lu.tmp", (long)pid,
                     (unsigned long)atomic_fetch_add(&temp_ids, 1));
            item->tmp = tmp;
        }
    }
    rc = 0;
done:
    PyMem_Free(lane);
    return rc;
}

static int clamp_threads(int threads, size_t units) {
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((size_t)threads > units)
        threads = units ? (int)units : 1;
    return threads;
}

PyDoc_STRVAR(write_blocks_doc,
"write_blocks(items, frame, fsync, threads) -> list[int]\n\n"
"items: list of (dir_fd, name: bytes, tmp: bytes, key: bytes, payload) where payload is\n"
"a buffer or a tuple of buffers. Each block: openat(tmp, O_EXCL|O_NOFOLLOW, 0600),\n"
"pwritev(header, payload), fdatasync if fsync, renameat(tmp, name); tmp unlinked on\n"
"failure. frame: the namespace hash, or (ns_hash, MAC key, key id) to sign. One outcome\n"
"per block: 0 or -errno.");

/* Write the parsed batch on `threads` threads (GIL released): one outcome per block. */
static PyObject *run_writes(Held *held, size_t n, const Frame *frame, int fsync, int threads,
                            double deadline) {
    Batch batch = {held->items, n, 0, *frame, fsync, 1, 0, deadline};
    threads = clamp_threads(threads, batch.n);
    Py_BEGIN_ALLOW_THREADS
    run_threads(write_worker, &batch, threads);
    Py_END_ALLOW_THREADS
    PyObject *result = PyList_New((Py_ssize_t)batch.n);
    for (size_t i = 0; result && i < batch.n; i++) {
        PyObject *code = PyLong_FromLong(held->items[i].code);
        if (code == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, (Py_ssize_t)i, code);
    }
    return result;
}

static PyObject *py_write_blocks(PyObject *self, PyObject *args) {
    PyObject *items;
    Frame frame;
    int fsync, threads;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "O!O&pi|d", &PyList_Type, &items, frame_arg, &frame, &fsync,
                          &threads, &deadline))
        return NULL;
    Held held = {0};
    PyObject *result = NULL;
    if (parse_items(items, &held, 0) == 0)
        result = run_writes(&held, (size_t)PyList_GET_SIZE(items), &frame, fsync, threads,
                            deadline);
    held_release(&held);
    return result;
}

PyDoc_STRVAR(write_batch_doc,
"write_batch(root_fd, keys, lanes, slots, num_blocks, frame, fsync, threads) -> list[int]\n\n"
"write_blocks for keys[i] (bytes of 1 to 100) from slot slots[i] of `lanes` (a tuple of\n"
"(buffer, offset, stride, size): the block's regions, lane by lane, are\n"
"buffer[offset + slot * stride:][:size]), each to its file \"ab/<key hex>.blk\" below\n"
"root_fd (opened by openat2 with no link followed; the fan-out directory made 0700 if\n"
"missing). One outcome per block: 0 or -errno. ValueError/IndexError for bad arguments\n"
"(nothing written).");

/* The core's calls that run as a job (`CoreJob`, below): in the calling thread
 * (`core_call`) or on a CoreQueue's threads. */
enum {
    SLAB_WRITE = 0,
    SLAB_READ = 1,
    SLAB_WRITE_ITEMS = 2,
    SLAB_READ_ITEMS = 3,
    FILES_WRITE_BATCH = 4, /* write_batch: a file per block, below a directory */
    FILES_READ_BATCH = 5,  /* read_batch */
};

static PyObject *core_call(int kind, PyObject *args);

static PyObject *py_write_batch(PyObject *self, PyObject *args) {
    return core_call(FILES_WRITE_BATCH, args);
}

PyDoc_STRVAR(read_blocks_doc,
"read_blocks(items, frame, threads) -> (list[int], dict[int, tuple[int, bytes]])\n\n"
"items: list of (dir_fd, name: bytes, key: bytes, slot, touch) where slot is a writable\n"
"buffer or a tuple of them. Each block: openat(name, O_NOFOLLOW), one preadv of header,\n"
"payload into the slot and a spare byte, the frame checked, the mtime refreshed if\n"
"touch. One outcome per block: 0, -errno, or a CORRUPT_* code (the file deleted if its\n"
"name still holds it); for those, {index: (bytes the file gave, header read)}.");

static PyObject *outcomes_of(Held *held, size_t n, const Frame *frame);

/* Read the parsed batch on `threads` threads (GIL released): (codes, details). */
static PyObject *run_reads(Held *held, size_t n, const Frame *frame, int threads,
                           double deadline) {
    Batch batch = {held->items, n, 0, *frame, 0, 1, 0, deadline};
    /* groups of PREFETCH_BLOCKS, smaller when that gives each thread one */
    threads = clamp_threads(threads, batch.n);
    size_t share = (batch.n + (size_t)threads - 1) / (size_t)threads;
    batch.group = share < PREFETCH_BLOCKS ? (share ? share : 1) : PREFETCH_BLOCKS;
    Py_BEGIN_ALLOW_THREADS
    run_threads(read_worker, &batch, threads);
    Py_END_ALLOW_THREADS
    return outcomes_of(held, batch.n, frame);
}

/* A read call's (codes, details): details for each block that failed a check, its
 * (bytes read, frame header read). */
static PyObject *outcomes_of(Held *held, size_t n, const Frame *frame) {
    PyObject *codes = PyList_New((Py_ssize_t)n);
    PyObject *details = PyDict_New();
    PyObject *result = NULL;
    for (size_t i = 0; codes && details && i < n; i++) {
        Item *item = &held->items[i];
        PyObject *code = PyLong_FromLong(item->code);
        if (code == NULL)
            goto fail;
        PyList_SET_ITEM(codes, (Py_ssize_t)i, code);
        if (item->code <= 0)
            continue;
        PyObject *detail = Py_BuildValue(
            "(ny#)", (Py_ssize_t)item->got, (const char *)item->head,
            (Py_ssize_t)head_bytes_of(frame, item->key_len));
        PyObject *index = PyLong_FromSize_t(i);
        int bad = !detail || !index || PyDict_SetItem(details, index, detail) != 0;
        Py_XDECREF(detail);
        Py_XDECREF(index);
        if (bad)
            goto fail;
    }
    if (codes && details)
        result = PyTuple_Pack(2, codes, details);
fail:
    Py_XDECREF(codes);
    Py_XDECREF(details);
    return result;
}

static PyObject *py_read_blocks(PyObject *self, PyObject *args) {
    PyObject *items;
    Frame frame;
    int threads;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "O!O&i|d", &PyList_Type, &items, frame_arg, &frame, &threads,
                          &deadline))
        return NULL;
    Held held = {0};
    PyObject *result = NULL;
    if (parse_items(items, &held, 1) == 0)
        result = run_reads(&held, (size_t)PyList_GET_SIZE(items), &frame, threads, deadline);
    held_release(&held);
    return result;
}

PyDoc_STRVAR(read_batch_doc,
"read_batch(root_fd, keys, lanes, slots, num_blocks, touch, frame, threads)\n"
"    -> (list[int], dict[int, tuple[int, bytes]])\n\n"
"read_blocks for keys[i] (bytes of 1 to 100) into slot slots[i] of `lanes` (as in\n"
"write_batch), each from its file \"ab/<key hex>.blk\" below root_fd (openat2, no link\n"
"followed); touch: None or bytes, a flag per key (refresh the mtime once read).\n"
"Outcomes as read_blocks'.");

static PyObject *py_read_batch(PyObject *self, PyObject *args) {
    return core_call(FILES_READ_BATCH, args);
}

/* -- slab calls: blocks in fixed slots of one preallocated file ------------------------- */

/* A slab file (slabfile.py, the format's description) is a superblock page, then slot
 * after slot of `room + PAGE` bytes; slot `place` of the tier is slot place / files of
 * file place % files (`slabfile.locate`). A slot is the payload from the slot's start (page aligned), zeros
 * to `room`, then the slot's header page:
 *     check u64 | magic "TKVSLOT1" | seq u64 | frame length u32 | 0 u32 | frame header
 * where the frame header is the file frame's (`build_header`, byte for byte) and check
 * is the xxh3_64 of everything after it up to the frame header's end. A block is one
 * pwritev (payload, zeros, header page) and one preadv of the same; no open, close,
 * rename, inode or allocation per block. A slot torn by a crash fails the header's
 * check or the payload's checksum: a miss, never wrong bytes. */
#define SLOT_HEAD_BYTES 32
static const unsigned char SLOT_MAGIC[8] = {'T', 'K', 'V', 'S', 'L', 'O', 'T', '1'};
static const unsigned char zero_page[PAGE];

/* The slot header into page (frame header already at page + SLOT_HEAD_BYTES). */
static void seal_slot(unsigned char *page, uint64_t seq, size_t frame_len) {
    memcpy(page + 8, SLOT_MAGIC, 8);
    put_le(page + 16, seq, 8);
    put_le(page + 24, frame_len, 4);
    put_le(page + 28, 0, 4);
    put_le(page, tkv_xxh3_64(page + 8, SLOT_HEAD_BYTES - 8 + frame_len), 8);
}

/* Whether page holds a whole slot header with a frame header of `frame_len` bytes (the
 * length is compared before anything past it is read: only that much was read). */
static int slot_holds(const unsigned char *page, size_t frame_len) {
    if (memcmp(page + 8, SLOT_MAGIC, 8) != 0 || get_le(page + 28, 4) != 0)
        return 0;
    if ((size_t)get_le(page + 24, 4) != frame_len || frame_len > PAGE - SLOT_HEAD_BYTES)
        return 0;
    return tkv_xxh3_64(page + 8, SLOT_HEAD_BYTES - 8 + frame_len) == get_le(page, 8);
}

/* The iovecs of a slot: the regions, zeros (or `pad`) to `room`, `tail` bytes of the
 * header page (writes: all of it, so that no page is read to be rewritten in part;
 * reads: the slot header and the frame header only). */
static struct iovec *slot_iov(const Batch *batch, const Item *item, unsigned char *pad,
                              unsigned char *page, size_t tail, struct iovec *local, int *n) {
    size_t gap = batch->room - item->payload_len;
    *n = item->nregions + (gap ? 2 : 1);
    struct iovec *iov = *n <= 16 ? local : malloc(sizeof *iov * (size_t)*n);
    if (iov == NULL)
        return NULL;
    memcpy(iov, item->regions, sizeof *iov * (size_t)item->nregions);
    int at = item->nregions;
    if (gap) {
        iov[at].iov_base = pad;
        iov[at++].iov_len = gap;
    }
    iov[at].iov_base = page;
    iov[at].iov_len = tail;
    return iov;
}

/* `page` is PAGE aligned (the worker's): a direct write takes it as it is. */
static long slab_write_one(const Batch *batch, Item *item, unsigned char *page) {
    memset(page, 0, PAGE);
    unsigned char *head = item->head;
    item->head = page + SLOT_HEAD_BYTES;
    long err = build_header(batch, item);
    item->head = head;
    if (err)
        return err;
    seal_slot(page, item->seq, head_bytes_of(&batch->frame, item->key_len));
    for (;;) {
        struct iovec local[16];
        int n;
        struct iovec *iov = slot_iov(batch, item, (unsigned char *)zero_page, page, PAGE, local, &n);
        if (iov == NULL)
            return -ENOMEM;
        err = write_all_at(item->dfd >= 0 ? item->dfd : item->fd, iov, n, item->offset);
        if (iov != local)
            free(iov);
        if (err != -EINVAL || item->dfd < 0)
            return err;
        item->dfd = -1; /* the filesystem refused this direct write: the whole slot, buffered */
    }
}

/* Read one slot into the item's regions and check it; a touch (item->seq) rewrites its
 * header page with the new sequence (a failed touch fails nothing). The frame header
 * read is copied to item->head (for the caller's message on a failed check). */
static long slab_read_one(const Batch *batch, Item *item, unsigned char *page, unsigned char *pad,
                          int nowait) {
    struct iovec local[16];
    int n;
    size_t frame_len = head_bytes_of(&batch->frame, item->key_len);
    /* buffered: the used part of the header page only; direct: all of it (whole pages) */
    size_t want = item->dfd >= 0 ? PAGE : SLOT_HEAD_BYTES + frame_len;
    struct iovec *iov = slot_iov(batch, item, pad, page, want, local, &n);
    if (iov == NULL)
        return -ENOMEM;
    int fd = item->dfd >= 0 ? item->dfd : item->fd;
    ssize_t got = read_all(fd, iov, n, item->offset, nowait ? RWF_NOWAIT : 0);
    if (iov != local)
        free(iov);
    if (got == -EINVAL && item->dfd >= 0) { /* the filesystem refused it: buffered */
        item->dfd = -1;
        return slab_read_one(batch, item, page, pad, nowait);
    }
    if (nowait && (got == -EAGAIN || (got >= 0 && (size_t)got < batch->room + want)))
        return NOT_CACHED; /* not all in the page cache (or past the end): read it plainly */
    if (nowait && (got == -EOPNOTSUPP || got == -EINVAL)) {
        atomic_store(&nowait_works, 0);
        return NOT_CACHED;
    }
    if (got < 0)
        return got;
    item->got = got;
    if ((size_t)got < batch->room + want)
        return CORRUPT_SLOT; /* past the slab's end: never written */
    if (!slot_holds(page, frame_len)) {
        memset(item->head, 0, frame_len);
        return CORRUPT_SLOT;
    }
    memcpy(item->head, page + SLOT_HEAD_BYTES, frame_len);
    long code = check_frame(batch, item);
    if (code == 0 && item->seq) { /* the rest of the page was not read: zeros, as written */
        memset(page + SLOT_HEAD_BYTES + frame_len, 0, PAGE - SLOT_HEAD_BYTES - frame_len);
        seal_slot(page, item->seq, frame_len);
        /* the same kind of descriptor as the read (page and offset are PAGE aligned);
         * either kind is coherent with the other (a direct write drops the cached pages
         * it covers, a direct read writes dirty ones back first) */
        off_t at = item->offset + (off_t)batch->room;
        if (item->dfd < 0 || pwrite(item->dfd, page, PAGE, at) < 0)
            (void)!pwrite(item->fd, page, PAGE, at);
    }
    return code;
}

/* Read blocks [first, end) of a slab call, as read_group does files: each at once if
 * the page cache holds its slot whole (RWF_NOWAIT); from the first it does not, advise
 * the rest's slots together (POSIX_FADV_WILLNEED: the slab files are FADV_RANDOM, so
 * nothing else is read ahead) and read them, so the disk works on all at once. */
static void slab_read_group(const Batch *batch, size_t first, size_t end, unsigned char *page,
                            unsigned char *pad) {
    size_t cold[PREFETCH_BLOCKS];
    size_t ncold = 0;
    int cached = atomic_load(&nowait_works);
    for (size_t i = first; i < end; i++) {
        if (past_deadline(batch)) {
            batch->items[i].code = -ECANCELED;
            continue;
        }
        if (batch->items[i].dfd >= 0) { /* O_DIRECT: past the page cache, nothing to advise */
            batch->items[i].code = slab_read_one(batch, &batch->items[i], page, pad, 0);
            continue;
        }
        long code = cached ? slab_read_one(batch, &batch->items[i], page, pad, 1) : NOT_CACHED;
        if (code == NOT_CACHED) {
            cold[ncold++] = i;
            cached = 0; /* the rest is likely cold too: advised and read with it */
        } else {
            batch->items[i].code = code;
        }
    }
    if (ncold > 1)
        for (size_t c = 0; c < ncold; c++) {
            const Item *item = &batch->items[cold[c]];
            posix_fadvise(item->fd, item->offset, (off_t)(batch->room + PAGE), POSIX_FADV_WILLNEED);
        }
    for (size_t c = 0; c < ncold; c++) {
        Item *item = &batch->items[cold[c]];
        item->code = past_deadline(batch) ? -ECANCELED : slab_read_one(batch, item, page, pad, 0);
    }
}

static void *slab_write_worker(void *arg) {
    Batch *batch = arg;
    unsigned char *page = aligned_alloc(PAGE, PAGE);
    size_t i;
    while ((i = atomic_fetch_add(&batch->next, 1)) < batch->n)
        batch->items[i].code = !page                 ? -ENOMEM
                               : past_deadline(batch) ? -ECANCELED
                                                      : slab_write_one(batch, &batch->items[i], page);
    free(page);
    return NULL;
}

static void *slab_read_worker(void *arg) {
    Batch *batch = arg;
    unsigned char *page = aligned_alloc(PAGE, 2 * PAGE);
    size_t g;
    while ((g = atomic_fetch_add(&batch->next, 1)) * batch->group < batch->n) {
        size_t first = g * batch->group;
        size_t end = first + batch->group < batch->n ? first + batch->group : batch->n;
        if (page == NULL)
            for (size_t i = first; i < end; i++)
                batch->items[i].code = -ENOMEM;
        else
            slab_read_group(batch, first, end, page, page + PAGE);
    }
    free(page);
    return NULL;
}

#define MAX_SLAB_FILES 256

/* The slab files' descriptors from a tuple of ints into fds[]; their count, or -1.
 * `least`: 1 for the buffered descriptors, 0 for the O_DIRECT ones (NULL: none). */
static int parse_fds(PyObject *tuple, int *fds, int least) {
    Py_ssize_t k = tuple ? PyTuple_GET_SIZE(tuple) : 0;
    if (k < least || k > MAX_SLAB_FILES) {
        PyErr_Format(PyExc_ValueError, "fds: %d to %d slab file descriptors", least,
                     MAX_SLAB_FILES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        fds[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
        if (fds[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return (int)k;
}

/* Parse a slab call's places and sequences (bytes of u64, one per key) into the items:
 * each block's file and offset (`slabfile.locate`). room: a positive PAGE multiple that
 * holds the payload. With the GIL held. */
static int parse_slab(Held *held, Py_ssize_t n, const int *fds, int nfds, const int *dfds,
                      int ndfds, Py_buffer *places, Py_buffer *seqs, Py_ssize_t room,
                      Py_ssize_t num_places, const Frame *frame) {
    if (ndfds && ndfds != nfds) {
        PyErr_Format(PyExc_ValueError, "direct_fds: none or one per slab file (%d), not %d",
                     nfds, ndfds);
        return -1;
    }
    if (places->len != n * 8 || (seqs->buf != NULL && seqs->len != n * 8)) {
        PyErr_SetString(PyExc_ValueError, "places and seqs: 8 bytes (u64) per key");
        return -1;
    }
    if (room <= 0 || room % PAGE) {
        PyErr_Format(PyExc_ValueError, "room %zd: a positive multiple of %d", room, PAGE);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const Item *item = &held->items[i];
        if ((size_t)room < item->payload_len ||
            head_bytes_of(frame, item->key_len) > PAGE - SLOT_HEAD_BYTES) {
            PyErr_Format(PyExc_ValueError, "block %zd: its payload does not fit a slot's room "
                         "of %zd or its key a slot's header page", i, room);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t place = get_le((const unsigned char *)places->buf + 8 * i, 8);
        if (place >= (uint64_t)num_places) {
            PyErr_Format(PyExc_IndexError, "place %llu is out of range 0..%zd",
                         (unsigned long long)place, num_places - 1);
            return -1;
        }
        Item *item = &held->items[i];
        item->fd = fds[place % (uint64_t)nfds];
        item->offset = (off_t)(PAGE + (place / (uint64_t)nfds) * (uint64_t)(room + PAGE));
        item->seq = seqs->buf ? get_le((const unsigned char *)seqs->buf + 8 * i, 8) : 0;
        /* O_DIRECT where the block's memory is whole pages filling the slot's room (no
         * zeros to add, no read past the block); else this block goes buffered */
        int direct = ndfds && item->payload_len == (size_t)room &&
                     (held->aligned > 0 || (held->aligned < 0 && item_aligned(item)));
        item->dfd = direct ? dfds[place % (uint64_t)nfds] : -1;
    }
    return 0;
}

/* -- a slab call as a job: parsed with the GIL, run without it, answered with it ------ */


/* One slab call: what it holds while its blocks move (buffers, items, descriptors),
 * and, in a CoreQueue, its place in the queue. */
typedef struct CoreJob {
    struct CoreJob *next;
    long long ticket;
    int reads;
    int files;             /* a file per block (write_batch, read_batch), not slab slots */
    Held held;
    Py_buffer places, seqs;
    int fds[MAX_SLAB_FILES], nfds, dfds[MAX_SLAB_FILES], ndfds;
    int fsync, threads;
    Batch batch;
} CoreJob;

static void core_job_free(CoreJob *job) {
    held_release(&job->held);
    PyBuffer_Release(&job->places);
    PyBuffer_Release(&job->seqs);
    PyMem_Free(job);
}

/* seqs of b"": none (reads without touches). */
static void no_empty_seqs(Py_buffer *seqs) {
    if (seqs->obj != NULL && seqs->len == 0)
        seqs->buf = NULL;
}

/* A slab call's tail arguments: places, seqs (b"" for none), room, num_places, frame. */
#define SLAB_TAIL "y*y*nnO&"

/* Parse the arguments of a slab call of `kind` (the four entry points' signatures) into
 * a new job, ready to run; NULL with an exception set. With the GIL held. */
static CoreJob *core_job_parse(int kind, PyObject *args) {
    CoreJob *job = PyMem_Calloc(1, sizeof(CoreJob));
    if (job == NULL)
        return (CoreJob *)PyErr_NoMemory();
    PyObject *files, *keys = NULL, *lanes, *slots, *items = NULL, *direct = NULL, *touch;
    Py_ssize_t num_blocks = 0, room, num_places;
    Frame frame;
    double deadline = 0;
    int ok, fsync = 0, root_fd;
    job->reads = kind == SLAB_READ || kind == SLAB_READ_ITEMS || kind == FILES_READ_BATCH;
    job->files = kind == FILES_WRITE_BATCH || kind == FILES_READ_BATCH;
    if (job->files) {
        ok = kind == FILES_WRITE_BATCH
                 ? PyArg_ParseTuple(args, "iO!O!O!nO&pi|d", &root_fd, &PyList_Type, &keys,
                                    &PyTuple_Type, &lanes, &PyList_Type, &slots, &num_blocks,
                                    frame_arg, &frame, &fsync, &job->threads, &deadline)
                 : PyArg_ParseTuple(args, "iO!O!O!nOO&i|d", &root_fd, &PyList_Type, &keys,
                                    &PyTuple_Type, &lanes, &PyList_Type, &slots, &num_blocks,
                                    &touch, frame_arg, &frame, &job->threads, &deadline);
        if (!ok || parse_batch(&job->held, root_fd, keys, lanes, slots, num_blocks,
                               job->reads ? touch : Py_None, job->reads, 1) != 0) {
            core_job_free(job);
            return NULL;
        }
        Batch batch = {job->held.items, (size_t)PyList_GET_SIZE(keys), 0, frame, fsync, 1, 0,
                       deadline};
        job->batch = batch;
        job->fsync = fsync;
        goto threads;
    }
    switch (kind) {
    case SLAB_WRITE:
        ok = PyArg_ParseTuple(args, "O!O!O!O!n" SLAB_TAIL "pi|O!d", &PyTuple_Type, &files,
                              &PyList_Type, &keys, &PyTuple_Type, &lanes, &PyList_Type, &slots,
                              &num_blocks, &job->places, &job->seqs, &room, &num_places,
                              frame_arg, &frame, &fsync, &job->threads, &PyTuple_Type, &direct,
                              &deadline);
        break;
    case SLAB_READ:
        ok = PyArg_ParseTuple(args, "O!O!O!O!n" SLAB_TAIL "i|O!d", &PyTuple_Type, &files,
                              &PyList_Type, &keys, &PyTuple_Type, &lanes, &PyList_Type, &slots,
                              &num_blocks, &job->places, &job->seqs, &room, &num_places,
                              frame_arg, &frame, &job->threads, &PyTuple_Type, &direct, &deadline);
        break;
    case SLAB_WRITE_ITEMS:
        ok = PyArg_ParseTuple(args, "O!O!" SLAB_TAIL "pi|O!d", &PyTuple_Type, &files,
                              &PyList_Type, &items, &job->places, &job->seqs, &room,
                              &num_places, frame_arg, &frame, &fsync, &job->threads, &PyTuple_Type,
                              &direct, &deadline);
        break;
    case SLAB_READ_ITEMS:
        ok = PyArg_ParseTuple(args, "O!O!" SLAB_TAIL "i|O!d", &PyTuple_Type, &files,
                              &PyList_Type, &items, &job->places, &job->seqs, &room,
                              &num_places, frame_arg, &frame, &job->threads, &PyTuple_Type, &direct,
                              &deadline);
        break;
    default:
        PyErr_Format(PyExc_ValueError, "unknown slab call kind %d", kind);
        ok = 0;
    }
    if (!ok) {
        core_job_free(job);
        return NULL;
    }
    if (job->reads)
        no_empty_seqs(&job->seqs);
    job->fsync = fsync;
    Py_ssize_t n = PyList_GET_SIZE(items ? items : keys);
    if ((job->nfds = parse_fds(files, job->fds, 1)) <= 0 ||
        (job->ndfds = parse_fds(direct, job->dfds, 0)) < 0 ||
        (items ? parse_items(items, &job->held, job->reads)
               : parse_batch(&job->held, -1, keys, lanes, slots, num_blocks, Py_None,
                             job->reads, 0)) != 0 ||
        parse_slab(&job->held, n, job->fds, job->nfds, job->dfds, job->ndfds, &job->places,
                   &job->seqs, room, num_places, &frame) != 0) {
        core_job_free(job);
        return NULL;
    }
    Batch batch = {job->held.items, (size_t)n, 0, frame, fsync, 1, (size_t)room, deadline};
    job->batch = batch;
threads:
    job->threads = clamp_threads(job->threads, job->batch.n);
    if (job->reads) { /* groups of PREFETCH_BLOCKS, smaller when that gives each thread one */
        size_t share = (job->batch.n + (size_t)job->threads - 1) / (size_t)job->threads;
        job->batch.group = share < PREFETCH_BLOCKS ? (share ? share : 1) : PREFETCH_BLOCKS;
    }
    return job;
}

/* Move a parsed job's blocks (no GIL): writes with one fdatasync per file written when
 * `fsync` (its failure fails that file's blocks). */
static void core_job_run(CoreJob *job) {
    Batch *batch = &job->batch;
    if (job->files) { /* each block's file fsynced by its own write (write_one) */
        run_threads(job->reads ? read_worker : write_worker, batch, job->threads);
        return;
    }
    run_threads(job->reads ? slab_read_worker : slab_write_worker, batch, job->threads);
    /* each file a block was written to, through its buffered descriptor (the same inode:
     * it flushes what the direct writes allocated, and the device's cache) */
    for (int f = 0; !job->reads && job->fsync && f < job->nfds; f++) {
        size_t i = 0;
        while (i < batch->n && (batch->items[i].fd != job->fds[f] || batch->items[i].code))
            i++;
        if (i == batch->n || fdatasync(job->fds[f]) == 0)
            continue;
        long err = -errno;
        for (i = 0; i < batch->n; i++)
            if (batch->items[i].fd == job->fds[f] && batch->items[i].code == 0)
                batch->items[i].code = err;
    }
}

/* A run job's answer (GIL held): writes' codes, reads' (codes, details). */
static PyObject *core_job_answer(CoreJob *job) {
    if (job->reads)
        return outcomes_of(&job->held, job->batch.n, &job->batch.frame);
    PyObject *result = PyList_New((Py_ssize_t)job->batch.n);
    for (size_t i = 0; result && i < job->batch.n; i++) {
        PyObject *code = PyLong_FromLong(job->held.items[i].code);
        if (code == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, (Py_ssize_t)i, code);
    }
    return result;
}

/* A core call made in the calling thread (GIL released while the blocks move). */
static PyObject *core_call(int kind, PyObject *args) {
    CoreJob *job = core_job_parse(kind, args);
    if (job == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    core_job_run(job);
    Py_END_ALLOW_THREADS
    PyObject *result = core_job_answer(job);
    core_job_free(job);
    return result;
}

PyDoc_STRVAR(slab_write_doc,
"slab_write(fds, keys, lanes, slots, num_blocks, places, seqs, room, num_places, frame,\n"
"           fsync, threads, direct_fds=()) -> list[int]\n\n"
"Each keys[i] (bytes of 1 to 100) from slot slots[i] of `lanes` (as write_batch's) into\n"
"slab slot places[i] (slot places[i] // len(fds) of file fds[places[i] % len(fds)];\n"
"places, seqs: bytes, a little-endian u64 per key), the slot's header sealed with\n"
"seqs[i]; room: payload bytes of a slot (a PAGE multiple). With fsync, one fdatasync\n"
"per file written after the whole batch (its failure fails that file's blocks).\n"
"direct_fds: () or the same files opened O_DIRECT, one per fd: the blocks go through\n"
"them when the lanes are whole pages (base, stride, size: PAGE multiples) filling a\n"
"slot's room, else buffered. One outcome per block: 0 or -errno.");

static PyObject *py_slab_write(PyObject *self, PyObject *args) {
    return core_call(SLAB_WRITE, args);
}

PyDoc_STRVAR(slab_write_items_doc,
"slab_write_items(fds, items, places, seqs, room, num_places, frame, fsync, threads,\n"
"                 direct_fds=()) -> list[int]\n\n"
"slab_write for blocks lent one by one: items is a list of (-1, b'', b'', key, payload),\n"
"payload a buffer or a tuple of buffers (write_blocks' items, no directory or name);\n"
"O_DIRECT (direct_fds) for each block whose regions are whole, aligned pages.");

static PyObject *py_slab_write_items(PyObject *self, PyObject *args) {
    return core_call(SLAB_WRITE_ITEMS, args);
}

PyDoc_STRVAR(slab_read_doc,
"slab_read(fds, keys, lanes, slots, num_blocks, places, seqs, room, num_places, frame,\n"
"          threads, direct_fds=()) -> (list[int], dict[int, tuple[int, bytes]])\n\n"
"Each keys[i] from slab slot places[i] (as slab_write's) into slot slots[i] of `lanes`,\n"
"checked (the slot's header, then the frame as read_batch checks it); seqs: b'' or a\n"
"u64 per key, non-zero to rewrite the slot's header with that sequence once read (a\n"
"touch). Outcomes as read_batch's, CORRUPT_SLOT for a slot whose own header fails.\n"
"direct_fds as slab_write's: a direct read takes the payload and the whole header page\n"
"(into an aligned buffer of the thread's); the page cache is neither asked nor advised.");

static PyObject *py_slab_read(PyObject *self, PyObject *args) {
    return core_call(SLAB_READ, args);
}

PyDoc_STRVAR(slab_read_items_doc,
"slab_read_items(fds, items, places, seqs, room, num_places, frame, threads,\n"
"                direct_fds=()) -> (list[int], dict[int, tuple[int, bytes]])\n\n"
"slab_read for blocks lent one by one: items is a list of (-1, b'', key, dest, False),\n"
"dest a writable buffer or a tuple of them (read_blocks' items, no directory or name);\n"
"O_DIRECT (direct_fds) for each block whose regions are whole, aligned pages.");

static PyObject *py_slab_read_items(PyObject *self, PyObject *args) {
    return core_call(SLAB_READ_ITEMS, args);
}

/* -- CoreQueue: slab calls on the core's own threads, answered through an eventfd ---- */

#define MAX_QUEUE_THREADS 64

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;
    CoreJob *pending, *pending_tail; /* submitted, not yet taken by a thread */
    CoreJob *done, *done_tail;       /* run, not yet collected */
    pthread_t ids[MAX_QUEUE_THREADS];
    int nthreads;
    int stopping;
    int efd;                         /* -1 once closed */
    Py_ssize_t in_flight;            /* submitted and not yet collected */
    pid_t pid;                       /* the process whose threads these are (not a fork) */
} CoreQueue;

static void *queue_worker(void *arg) {
    CoreQueue *q = arg;
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->pending == NULL && !q->stopping)
            pthread_cond_wait(&q->wake, &q->lock);
        CoreJob *job = q->pending;
        if (job == NULL)
            break; /* stopping, and nothing left to run */
        q->pending = job->next;
        if (q->pending == NULL)
            q->pending_tail = NULL;
        pthread_mutex_unlock(&q->lock);
        core_job_run(job);
        pthread_mutex_lock(&q->lock);
        job->next = NULL;
        int first = q->done == NULL; /* else a wake-up is on its way for the list */
        if (q->done_tail)
            q->done_tail->next = job;
        else
            q->done = job;
        q->done_tail = job;
        pthread_mutex_unlock(&q->lock);
        /* outside the lock: the loop's collect and the other threads do not wait on a
         * system call (collect reads the eventfd before it takes the list, so a job
         * added after it took one makes its own wake-up) */
        uint64_t one = 1;
        while (first && write(q->efd, &one, sizeof one) < 0 && errno == EINTR)
            ;
        pthread_mutex_lock(&q->lock);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

static int queue_init(CoreQueue *q, PyObject *args, PyObject *kwds) {
    int threads;
    if (!PyArg_ParseTuple(args, "i", &threads))
        return -1;
    if (threads < 1 || threads > MAX_QUEUE_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads: 1 to %d, not %d", MAX_QUEUE_THREADS, threads);
        return -1;
    }
    if (q->nthreads || q->efd > 0) {
        PyErr_SetString(PyExc_RuntimeError, "CoreQueue already initialised");
        return -1;
    }
    q->pid = getpid();
    q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->efd < 0) {
        q->efd = -1;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->wake, NULL);
    for (int t = 0; t < threads; t++)
        if (pthread_create(&q->ids[q->nthreads], NULL, queue_worker, q) == 0)
            q->nthreads++;
    if (q->nthreads == 0) {
        close(q->efd);
        q->efd = -1;
        PyErr_SetString(PyExc_OSError, "CoreQueue: no thread could be started");
        return -1;
    }
    return 0;
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    CoreQueue *q = (CoreQueue *)type->tp_alloc(type, 0);
    if (q != NULL)
        q->efd = -1;
    return (PyObject *)q;
}

/* Stop the threads once the queue is empty (GIL released while they finish), close the
 * eventfd; jobs run and not collected are freed. */
static void queue_stop(CoreQueue *q) {
    if (q->nthreads == 0 && q->efd < 0)
        return;
    if (getpid() != q->pid) { /* a forked child: no threads to stop, jobs are the parent's */
        q->nthreads = 0;
        if (q->efd >= 0)
            close(q->efd);
        q->efd = -1;
        return;
    }
    pthread_mutex_lock(&q->lock);
    q->stopping = 1;
    pthread_cond_broadcast(&q->wake);
    pthread_mutex_unlock(&q->lock);
    int n = q->nthreads;
    q->nthreads = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < n; t++)
        pthread_join(q->ids[t], NULL);
    Py_END_ALLOW_THREADS
    while (q->done) {
        CoreJob *job = q->done;
        q->done = job->next;
        core_job_free(job);
    }
    q->done_tail = NULL;
    if (q->efd >= 0)
        close(q->efd);
    q->efd = -1;
    q->in_flight = 0;
}

static void queue_dealloc(CoreQueue *q) {
    queue_stop(q);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *queue_fileno(CoreQueue *q, PyObject *unused) {
    if (q->efd < 0) {
        PyErr_SetString(PyExc_ValueError, "CoreQueue is closed");
        return NULL;
    }
    return PyLong_FromLong(q->efd);
}

static PyObject *queue_submit(CoreQueue *q, PyObject *args) {
    long long ticket;
    int kind;
    PyObject *call;
    if (!PyArg_ParseTuple(args, "LiO!", &ticket, &kind, &PyTuple_Type, &call))
        return NULL;
    if (q->efd < 0 || q->stopping) {
        PyErr_SetString(PyExc_ValueError, "CoreQueue is closed");
        return NULL;
    }
    if (getpid() != q->pid) { /* a fork: the threads stayed with the parent */
        PyErr_SetString(PyExc_RuntimeError, "CoreQueue used in a forked child: its threads "
                        "are the parent's; open the tier in this process");
        return NULL;
    }
    CoreJob *job = core_job_parse(kind, call);
    if (job == NULL)
        return NULL;
    job->ticket = ticket;
    /* Without the GIL: waking a thread may hand it this CPU at once (the wakee runs
     * before the waker on a busy machine), and a thread waiting for its CPU back must
     * not hold the GIL the process's other threads need. Closed meanwhile (stopping
     * is set under the lock): refused, as above. */
    int closed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    closed = q->stopping;
    if (!closed) {
        if (q->pending_tail)
            q->pending_tail->next = job;
        else
            q->pending = job;
        q->pending_tail = job;
    }
    pthread_mutex_unlock(&q->lock);
    if (!closed)
        pthread_cond_signal(&q->wake); /* after the unlock: the woken thread takes it at once */
    Py_END_ALLOW_THREADS
    if (closed) {
        core_job_free(job);
        PyErr_SetString(PyExc_ValueError, "CoreQueue is closed");
        return NULL;
    }
    q->in_flight++;
    Py_RETURN_NONE;
}

/* Every job run since the last call, as (ticket, answer): the answer as the slab call's,
 * or the exception building it raised. Clears the eventfd. */
static PyObject *queue_collect(CoreQueue *q, PyObject *unused) {
    if (q->efd < 0)
        return PyList_New(0);
    uint64_t count;
    while (read(q->efd, &count, sizeof count) < 0 && errno == EINTR)
        ;
    pthread_mutex_lock(&q->lock);
    CoreJob *job = q->done;
    q->done = q->done_tail = NULL;
    pthread_mutex_unlock(&q->lock);
    PyObject *answers = PyList_New(0);
    while (job) {
        CoreJob *next = job->next;
        PyObject *answer = core_job_answer(job);
        if (answer == NULL) { /* hand the error to its caller, not to this one */
            PyObject *type, *value, *trace;
            PyErr_Fetch(&type, &value, &trace);
            PyErr_NormalizeException(&type, &value, &trace);
            Py_XDECREF(type);
            Py_XDECREF(trace);
            answer = value ? value : Py_NewRef(Py_None);
        }
        PyObject *pair = answers ? Py_BuildValue("(LN)", job->ticket, answer) : NULL;
        if (pair == NULL || PyList_Append(answers, pair) != 0)
            Py_CLEAR(answers); /* out of memory: the waiters are never answered */
        Py_XDECREF(pair);
        core_job_free(job);
        q->in_flight--;
        job = next;
    }
    return answers;
}

static PyObject *queue_close(CoreQueue *q, PyObject *unused) {
    queue_stop(q);
    Py_RETURN_NONE;
}

static PyObject *queue_in_flight(CoreQueue *q, void *closure) {
    return PyLong_FromSsize_t(q->in_flight);
}

static PyMethodDef queue_methods[] = {
    {"fileno", (PyCFunction)queue_fileno, METH_NOARGS,
     "fileno() -> int: the eventfd that becomes readable when a job has run."},
    {"submit", (PyCFunction)queue_submit, METH_VARARGS,
     "submit(ticket, kind, args): queue the slab call `kind` (SLAB_WRITE, SLAB_READ,\n"
     "SLAB_WRITE_ITEMS, SLAB_READ_ITEMS) with `args` as that call takes them; bad\n"
     "arguments raise here, nothing queued. Its answer comes back from collect()."},
    {"collect", (PyCFunction)queue_collect, METH_NOARGS,
     "collect() -> list[tuple[int, object]]: (ticket, answer) of each job run since the\n"
     "last collect; the answer is the slab call's, or the exception building it raised."},
    {"close", (PyCFunction)queue_close, METH_NOARGS,
     "close(): let the threads finish the queued jobs, then stop them; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef queue_getset[] = {
    {"in_flight", (getter)queue_in_flight, NULL, "jobs submitted and not yet collected", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_batchio.CoreQueue",
    .tp_doc = "CoreQueue(threads): slab calls run on the core's own threads, no GIL taken\n"
              "there; each job's answer is collected on the caller's side once the eventfd\n"
              "(fileno) is readable.",
    .tp_basicsize = sizeof(CoreQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = queue_new,
    .tp_init = (initproc)queue_init,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_methods = queue_methods,
    .tp_getset = queue_getset,
};


PyDoc_STRVAR(slab_scan_doc,
"slab_scan(fd, index, files, room, frame, block_bytes, cold=False)\n"
"    -> (list[tuple[int, int, bytes]], int)\n\n"
"slabfile.scan: every slot of slab file `index` (of `files`) whose\n"
"header page is whole and names a block of this namespace and size, as (place, seq,\n"
"key); and the count of slots whose header is whole but whose frame header fails.\n"
"Holes (slots never written) are skipped with SEEK_DATA. The GIL is released. Once a\n"
"few header page reads in a row take COLD_READ_NS (from the disk; or from the start with\n"
"cold=True: tests), each read first asks for the next SCAN_AHEAD slots' header pages.");

typedef struct {
    uint64_t place, seq;
    size_t key_at, key_len;
} Found;

#define SCAN_AHEAD 64     /* header pages a cold scan has asked the disk for ahead of it */
#define COLD_READ_NS 10000 /* a header page read this slow came from the disk... */
#define COLD_READS 3       /* ...when this many in a row were (one may be a preemption) */

/* One slot's header page at `head` into `page` for the scan. Until COLD_READS reads in a
 * row take COLD_READ_NS or longer (the pages come from the disk: a restart's cold file;
 * *cold counts them, COLD_READS from the start when the caller says), pages are read as
 * they come; once cold, every read first asks the kernel for the next SCAN_AHEAD slots'
 * header pages
 * (POSIX_FADV_WILLNEED, which reads them asynchronously, past the files'
 * POSIX_FADV_RANDOM), so the disk has that many reads in flight instead of one: a header
 * page per slot at queue depth 1 cost a cold scan 60-75 us a slot on the dev VM's disk.
 * By time, not RWF_NOWAIT: tmpfs refuses that flag, and its reads are never cold.
 * pread's answer. */
static ssize_t scan_read(int fd, unsigned char *page, off_t head, uint64_t slot, uint64_t slots,
                         size_t slot_bytes, size_t room, int *cold, uint64_t *advised) {
    if (*cold < COLD_READS) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ssize_t got = pread(fd, page, PAGE, head);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long ns = (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec);
        *cold = ns >= COLD_READ_NS ? *cold + 1 : 0;
        return got;
    }
    if (*advised < slot)
        *advised = slot;
    for (; *advised < slots && *advised < slot + SCAN_AHEAD; (*advised)++)
        posix_fadvise(fd, (off_t)(PAGE + *advised * slot_bytes + room), PAGE, POSIX_FADV_WILLNEED);
    return pread(fd, page, PAGE, head);
}

static PyObject *py_slab_scan(PyObject *self, PyObject *args) {
    int fd, index, files;
    Py_ssize_t room, block_bytes;
    Frame frame;
    int cold = 0;
    if (!PyArg_ParseTuple(args, "iiinO&n|p", &fd, &index, &files, &room, frame_arg, &frame,
                          &block_bytes, &cold))
        return NULL;
    cold = cold ? COLD_READS : 0; /* from here on: slow reads in a row */
    size_t sig = frame.mac ? SIG_BYTES : 0;
    if (room <= 0 || room % PAGE || files < 1 || index < 0 || index >= files) {
        PyErr_SetString(PyExc_ValueError, "room: a positive PAGE multiple; 0 <= index < files");
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    size_t slot_bytes = (size_t)room + PAGE;
    uint64_t slots = st.st_size > PAGE ? (uint64_t)(st.st_size - PAGE) / slot_bytes : 0;
    Found *found = NULL;
    unsigned char *keys = NULL, *page = NULL;
    size_t nfound = 0, cap = 0, keys_used = 0, keys_cap = 0;
    long bad = 0;
    int err = 0;
    uint64_t advised = 0;
    Py_BEGIN_ALLOW_THREADS
    page = aligned_alloc(PAGE, PAGE);
    if (page == NULL)
        err = ENOMEM;
    for (uint64_t slot = 0; !err && slot < slots;) {
        off_t head = (off_t)(PAGE + slot * slot_bytes + (size_t)room);
        ssize_t got = scan_read(fd, page, head, slot, slots, slot_bytes, (size_t)room, &cold, &advised);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (got < PAGE)
            break;
        if (memcmp(page + 8, SLOT_MAGIC, 8) != 0) {
            int hole = 1;
            for (int i = 0; i < SLOT_HEAD_BYTES; i++)
                hole &= page[i] == 0;
            if (hole) { /* never written: go to the next slot with data */
                off_t data = lseek(fd, head + PAGE, SEEK_DATA);
                if (data < 0 && errno == ENXIO)
                    break; /* no data past here */
                if (data < 0) { /* SEEK_DATA unsupported here: the next slot */
                    slot++;
                    continue;
                }
                uint64_t next = data > PAGE ? (uint64_t)(data - PAGE) / slot_bytes : 0;
                slot = next > slot ? next : slot + 1;
                continue;
            }
            slot++;
            continue;
        }
        size_t frame_len = (size_t)get_le(page + 24, 4);
        if (!slot_holds(page, frame_len)) {
            slot++;
            continue;
        }
        const unsigned char *h = page + SLOT_HEAD_BYTES;
        /* a signing tier's frames: its flags and key id (another key's are not its own) */
        size_t key_len = frame_len > FIXED_HEADER_BYTES + sig ? frame_len - FIXED_HEADER_BYTES - sig : 0;
        if (key_len == 0 || memcmp(h, MAGIC, 4) != 0 || get_le(h + 4, 2) != FORMAT_VERSION ||
            get_le(h + 6, 2) != (frame.mac ? FLAG_MAC | FLAG_KEY_ID : 0) ||
            get_le(h + 8, 8) != frame.ns_hash || get_le(h + 16, 8) != (uint64_t)block_bytes ||
            get_le(h + 32, 2) != key_len ||
            (frame.mac && memcmp(h + FIXED_HEADER_BYTES + key_len, frame.key_id, KEY_ID_BYTES))) {
            bad++;
            slot++;
            continue;
        }
        if (nfound == cap) {
            cap = cap ? 2 * cap : 1024;
            Found *more = realloc(found, cap * sizeof *found);
            if (more == NULL) {
                err = ENOMEM;
                break;
            }
            found = more;
        }
        if (keys_used + key_len > keys_cap) {
            keys_cap = (keys_cap ? 2 * keys_cap : 65536) + key_len;
            unsigned char *more = realloc(keys, keys_cap);
            if (more == NULL) {
                err = ENOMEM;
                break;
            }
            keys = more;
        }
        memcpy(keys + keys_used, h + FIXED_HEADER_BYTES, key_len);
        found[nfound].place = slot * (uint64_t)files + (uint64_t)index;
        found[nfound].seq = get_le(page + 16, 8);
        found[nfound].key_at = keys_used;
        found[nfound].key_len = key_len;
        keys_used += key_len;
        nfound++;
        slot++;
    }
    free(page);
    Py_END_ALLOW_THREADS
    PyObject *list = NULL, *result = NULL;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    list = PyList_New((Py_ssize_t)nfound);
    for (size_t i = 0; list && i < nfound; i++) {
        PyObject *one = Py_BuildValue("(KKy#)", (unsigned long long)found[i].place,
                                      (unsigned long long)found[i].seq,
                                      (const char *)keys + found[i].key_at,
                                      (Py_ssize_t)found[i].key_len);
        if (one == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, one);
    }
    if (list != NULL)
        result = Py_BuildValue("(Nl)", list, bad);
done:
    free(found);
    free(keys);
    return result;
}

/* -- the native reference: the same block files, plain C ----------------------------- */

/* What a per-block data path can reach on this machine's filesystem, measured in the
 * same run as the tier (`tierkv bench`, benchmarks/nvme_engines.py): `blocks` files of
 * `block_bytes` under DIR/xx/ (256 fan-out directories), one open + pwrite|pread +
 * close per file, no frame, no checksum, `threads` threads. */
typedef struct {
    int dir_fd;
    long blocks, block_bytes;
    int writes, threads, fsync;
    atomic_long next;
    atomic_int failed;
} Reference;

static void *reference_worker(void *arg) {
    Reference *r = arg;
    char *buf = aligned_alloc(PAGE, (size_t)(r->block_bytes + PAGE - 1) / PAGE * PAGE);
    if (buf == NULL) {
        atomic_store(&r->failed, ENOMEM);
        return NULL;
    }
    memset(buf, 0x5a, (size_t)r->block_bytes);
    long i;
    char name[64];
    while ((i = atomic_fetch_add(&r->next, 1)) < r->blocks && !atomic_load(&r->failed)) {
        snprintf(name, sizeof name, "%02lx/%ld.blk", i & 0xff, i);
        int fd = r->writes ? openat(r->dir_fd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)
                           : openat(r->dir_fd, name, O_RDONLY | O_NOATIME | O_CLOEXEC);
        if (fd < 0) {
            atomic_store(&r->failed, errno);
            break;
        }
        ssize_t done = r->writes ? pwrite(fd, buf, (size_t)r->block_bytes, 0)
                                 : pread(fd, buf, (size_t)r->block_bytes, 0);
        if (done != r->block_bytes)
            atomic_store(&r->failed, done < 0 ? errno : EIO);
        else if (r->writes && r->fsync && fdatasync(fd) != 0)
            atomic_store(&r->failed, errno);
        close(fd);
    }
    free(buf);
    return NULL;
}

static double seconds_now(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

PyDoc_STRVAR(reference_doc,
"reference(op, dir_fd, blocks, block_bytes, threads, fsync=False) -> (seconds, cpu_seconds)\n\n"
"The native reference: op 'write' or 'read' of `blocks` files of `block_bytes` under\n"
"dir_fd as xx/<i>.blk (the fan-out directories must exist), one open + pwrite|pread +\n"
"close per file (fdatasync before close with fsync), no frame or checksum, on\n"
"`threads` threads, GIL released. Wall and\n"
"process CPU seconds. OSError on the first failure.");

static PyObject *py_reference(PyObject *self, PyObject *args) {
    const char *op;
    Reference r = {0};
    if (!PyArg_ParseTuple(args, "silli|p", &op, &r.dir_fd, &r.blocks, &r.block_bytes, &r.threads,
                          &r.fsync))
        return NULL;
    if ((strcmp(op, "write") && strcmp(op, "read")) || r.blocks < 0 || r.block_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "op 'write' or 'read', blocks >= 0, block_bytes > 0");
        return NULL;
    }
    r.writes = !strcmp(op, "write");
    int threads = clamp_threads(r.threads, (size_t)(r.blocks ? r.blocks : 1));
    double wall, cpu;
    Py_BEGIN_ALLOW_THREADS
    cpu = seconds_now(CLOCK_PROCESS_CPUTIME_ID);
    wall = seconds_now(CLOCK_MONOTONIC);
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&ids[started], NULL, reference_worker, &r) == 0)
            started++;
    reference_worker(&r);
    for (int t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
    wall = seconds_now(CLOCK_MONOTONIC) - wall;
    cpu = seconds_now(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    Py_END_ALLOW_THREADS
    if (atomic_load(&r.failed)) {
        errno = atomic_load(&r.failed);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(dd)", wall, cpu);
}

static PyObject *py_beneath_works(PyObject *self, PyObject *args) {
    int dir_fd = -1;
    if (!PyArg_ParseTuple(args, "|i", &dir_fd))
        return NULL;
    if (dir_fd >= 0 && atomic_load(&openat2_works)) { /* try it: a seccomp filter may refuse */
        int fd = open_in(dir_fd, ".", 1, O_RDONLY | O_DIRECTORY, 0);
        if (fd >= 0)
            close(fd);
        else
            atomic_store(&openat2_works, 0);
    }
    return PyBool_FromLong(atomic_load(&openat2_works));
}

PyDoc_STRVAR(encode_header_doc,
"encode_header(frame, key, payload) -> bytes\n\n"
"The frame header the writes put before `payload` (a buffer or tuple of buffers):\n"
"Framer.encode_header, signed when `frame` carries a key, for tests that it is\n"
"byte-identical.");

static PyObject *py_encode_header(PyObject *self, PyObject *args) {
    Frame frame;
    PyObject *key, *payload;
    if (!PyArg_ParseTuple(args, "O&SO", frame_arg, &frame, &key, &payload))
        return NULL;
    PyObject *one = Py_BuildValue("[(iyyOO)]", -1, "", "", key, payload);
    if (one == NULL)
        return NULL;
    Held held = {0};
    PyObject *result = NULL;
    if (parse_items(one, &held, 0) == 0) {
        Batch batch = {held.items, 1, 0, frame, 0, 1, 0, 0};
        int err = build_header(&batch, &held.items[0]);
        if (err)
            PyErr_SetFromErrno(PyExc_OSError);
        else
            result = PyBytes_FromStringAndSize(
                (const char *)held.items[0].head,
                (Py_ssize_t)head_bytes_of(&frame, held.items[0].key_len));
    }
    held_release(&held);
    Py_DECREF(one);
    return result;
}

/* The buffers of a tuple of bytes-likes, as iovecs, held until parts_release: the
 * input of the test entry points for the core's hashes. */
typedef struct {
    Py_ssize_t held;
    Py_buffer *views;
    struct iovec *iov;
} Parts;

static void parts_release(Parts *parts) {
    for (Py_ssize_t i = 0; i < parts->held; i++)
        PyBuffer_Release(&parts->views[i]);
    PyMem_Free(parts->views);
    PyMem_Free(parts->iov);
}

/* 0, or -1 with the exception set (and nothing held). */
static int parts_hold(PyObject *tuple, Parts *parts) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    parts->held = 0;
    parts->views = PyMem_Calloc((size_t)n + 1, sizeof *parts->views);
    parts->iov = PyMem_Calloc((size_t)n + 1, sizeof *parts->iov);
    if (parts->views == NULL || parts->iov == NULL) {
        PyErr_NoMemory();
        parts_release(parts);
        return -1;
    }
    for (; parts->held < n; parts->held++) {
        Py_buffer *view = &parts->views[parts->held];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, parts->held), view, PyBUF_SIMPLE) != 0) {
            parts_release(parts);
            return -1;
        }
        parts->iov[parts->held].iov_base = view->buf;
        parts->iov[parts->held].iov_len = (size_t)view->len;
    }
    return 0;
}

PyDoc_STRVAR(keyed_hash_doc,
"keyed_hash(key, parts, lanes=0) -> bytes\n\n"
"The 32-byte keyed BLAKE3 of the buffers `parts` (a tuple) joined, as the frames' MAC\n"
"is made (`_blake3.c`): blake3.blake3(b''.join(parts), key=key).digest(), for tests;\n"
"lanes: 1, 8 or 16 chunks at once at most (0: as many as the CPU does, BLAKE3_LANES).");

static PyObject *py_keyed_hash(PyObject *self, PyObject *args) {
    const char *key;
    Py_ssize_t key_len;
    PyObject *tuple;
    int lanes = 0;
    if (!PyArg_ParseTuple(args, "y#O!|i", &key, &key_len, &PyTuple_Type, &tuple, &lanes))
        return NULL;
    if (key_len != TKV_BLAKE3_KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "key: %d bytes, not %zd", TKV_BLAKE3_KEY_BYTES, key_len);
        return NULL;
    }
    Parts parts;
    if (parts_hold(tuple, &parts) != 0)
        return NULL;
    uint8_t out[TKV_BLAKE3_OUT_BYTES];
    Py_BEGIN_ALLOW_THREADS
    tkv_blake3_keyed_lanes((const uint8_t *)key, parts.iov, (int)parts.held, out,
                           lanes ? lanes : tkv_blake3_lanes());
    Py_END_ALLOW_THREADS
    parts_release(&parts);
    return PyBytes_FromStringAndSize((const char *)out, TKV_BLAKE3_OUT_BYTES);
}

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(parts, bits=0) -> int\n\n"
"The xxh3_64 of the buffers `parts` (a tuple) joined, as the frames' checksum is made\n"
"(`_xxh3.c`): xxhash.xxh3_64_intdigest(b''.join(parts)), for tests; bits: the widest\n"
"vectors the stripe loop may use, 512, 256, 128 or 64 (0: the CPU's, XXH3_VECTOR_BITS).");

static PyObject *py_xxh3_64(PyObject *self, PyObject *args) {
    PyObject *tuple;
    int bits = 0;
    if (!PyArg_ParseTuple(args, "O!|i", &PyTuple_Type, &tuple, &bits))
        return NULL;
    Parts parts;
    if (parts_hold(tuple, &parts) != 0)
        return NULL;
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    sum = tkv_xxh3_64_parts_bits(parts.iov, (int)parts.held, bits ? bits : tkv_xxh3_vector_bits());
    Py_END_ALLOW_THREADS
    parts_release(&parts);
    return PyLong_FromUnsignedLongLong(sum);
}

PyDoc_STRVAR(direct_aligned_doc,
"direct_aligned(lanes) -> bool\n\n"
"Whether the slab calls move blocks of this geometry ((buffer, offset, stride, size)\n"
"per lane) with O_DIRECT when given direct_fds: every lane's start, stride and size\n"
"are multiples of 4096 (the same test the calls make).");

static PyObject *py_direct_aligned(PyObject *self, PyObject *lanes) {
    if (!PyTuple_Check(lanes) || PyTuple_GET_SIZE(lanes) < 1) {
        PyErr_SetString(PyExc_TypeError, "lanes: a tuple of (buffer, offset, stride, size)");
        return NULL;
    }
    int aligned = 1;
    for (Py_ssize_t l = 0; aligned && l < PyTuple_GET_SIZE(lanes); l++) {
        PyObject *buffer;
        Py_ssize_t offset, stride, size;
        Py_buffer view;
        PyObject *t = PyTuple_GET_ITEM(lanes, l);
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "Onnn", &buffer, &offset, &stride, &size)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "lane %zd: (buffer, offset, stride, size) expected", l);
            return NULL;
        }
        if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) != 0)
            return NULL;
        aligned = region_aligned((char *)view.buf + offset, stride, size);
        PyBuffer_Release(&view);
    }
    return PyBool_FromLong(aligned);
}

static PyMethodDef methods[] = {
    {"write_blocks", py_write_blocks, METH_VARARGS, write_blocks_doc},
    {"read_blocks", py_read_blocks, METH_VARARGS, read_blocks_doc},
    {"encode_header", py_encode_header, METH_VARARGS, encode_header_doc},
    {"write_batch", py_write_batch, METH_VARARGS, write_batch_doc},
    {"reference", py_reference, METH_VARARGS, reference_doc},
    {"read_batch", py_read_batch, METH_VARARGS, read_batch_doc},
    {"slab_write", py_slab_write, METH_VARARGS, slab_write_doc},
    {"slab_read", py_slab_read, METH_VARARGS, slab_read_doc},
    {"slab_write_items", py_slab_write_items, METH_VARARGS, slab_write_items_doc},
    {"slab_scan", py_slab_scan, METH_VARARGS, slab_scan_doc},
    {"slab_read_items", py_slab_read_items, METH_VARARGS, slab_read_items_doc},
    {"direct_aligned", py_direct_aligned, METH_O, direct_aligned_doc},
    {"keyed_hash", py_keyed_hash, METH_VARARGS, keyed_hash_doc},
    {"xxh3_64", py_xxh3_64, METH_VARARGS, xxh3_64_doc},
    {"beneath_works", py_beneath_works, METH_VARARGS,
     "beneath_works(dir_fd=-1) -> bool: whether the batch calls can open below a directory\n"
     "(openat2); with dir_fd, tried on it first (a refusal turns the batch calls off)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_batchio",
    .m_doc = "The nvme tier's block files, a whole batch per call, in C (see native.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__batchio(void) {
    if (PyType_Ready(&CoreQueueType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "CoreQueue", (PyObject *)&CoreQueueType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "PREFETCH_BLOCKS", PREFETCH_BLOCKS) ||
        PyModule_AddIntConstant(m, "CORRUPT_SHORT", CORRUPT_SHORT) ||
        PyModule_AddIntConstant(m, "CORRUPT_LONG", CORRUPT_LONG) ||
        PyModule_AddIntConstant(m, "CORRUPT_CHECKSUM", CORRUPT_CHECKSUM) ||
        PyModule_AddIntConstant(m, "CORRUPT_SLOT", CORRUPT_SLOT) ||
        PyModule_AddIntConstant(m, "CORRUPT_MAC", CORRUPT_MAC) ||
        PyModule_AddIntConstant(m, "BLAKE3_LANES", tkv_blake3_lanes()) ||
        PyModule_AddIntConstant(m, "SLOT_HEAD_BYTES", SLOT_HEAD_BYTES) ||
        PyModule_AddIntConstant(m, "SLAB_WRITE", SLAB_WRITE) ||
        PyModule_AddIntConstant(m, "SLAB_READ", SLAB_READ) ||
        PyModule_AddIntConstant(m, "SLAB_WRITE_ITEMS", SLAB_WRITE_ITEMS) ||
        PyModule_AddIntConstant(m, "SLAB_READ_ITEMS", SLAB_READ_ITEMS) ||
        PyModule_AddIntConstant(m, "FILES_WRITE_BATCH", FILES_WRITE_BATCH) ||
        PyModule_AddIntConstant(m, "FILES_READ_BATCH", FILES_READ_BATCH) ||
        PyModule_AddIntConstant(m, "XXH3_VECTOR_BITS", tkv_xxh3_vector_bits())) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
