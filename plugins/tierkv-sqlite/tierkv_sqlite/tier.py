"""`sqlite`: tierkv blocks in one SQLite database file.

A complete third-party tier, written only against tierkv's plugin contract: every
name it uses comes from `tierkv.tier`. Its README walks through it.

How it keeps the contract:

- Every block is stored framed (`self.framer.encode`, with a MAC when the config sets
  `mac_key_env`) and checked on the way back (`self.framer.decode_into`): a row that
  fails the check is deleted, its key reported failed and `report_removed`.
- Each job is one worker-thread call (`in_thread`) and one transaction, run by
  `run_job` as a single batch (so the job's deadline and late keys come from the
  contract): a thread round trip costs ~50 us, so one per job rather than one per
  block; the event loop never waits on SQLite.
- One connection, used by one thread at a time (a `CapacityLimiter(1)`), because a
  `sqlite3.Connection` must not be used by two threads at once.
- The tier's counters (bytes held, the recency clock) change only inside those thread
  calls, in step with the transaction, so a cancelled job cannot make them disagree
  with the database: after any failed transaction they are re-read from it.
- Capacity counts frame bytes (`framer.header_bytes(key)` + block bytes per block);
  past it the least recently used rows go first (recency is an integer clock stored
  per row, so it survives a restart), and the evicted keys are `report_removed`.
  Rows a lookup claimed (`protects_claims`: `self.claims`, safe from the worker
  thread) are passed over until their load or lease ends; a block that would need
  one of them evicted fails "no room" instead.
- Rows are keyed by the namespace's 8-byte hash followed by the block key, so caches
  of different namespaces may share one database file: each sees, counts and evicts
  only its own rows (`capacity` is per namespace).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from pydantic import Field

from tierkv.tier import (
    FILE_MODE,
    NO_ROOM,
    Batch,
    CorruptBlock,
    InFlightJobs,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    Size,
    TierConfig,
    TierUnavailable,
    directory_problem,
    in_thread,
    make_directories,
    run_job,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    key   BLOB PRIMARY KEY,
    frame BLOB NOT NULL,
    used  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_by_use ON blocks (used);
"""
_KEYS_PER_QUERY = 500  # keys in one `IN (...)`, well under SQLite's variable limit


class SqliteTierConfig(TierConfig):
    """The tier's YAML section: `{type: sqlite, path: /var/cache/kv.db, capacity: 4GiB}`."""

    path: Path = Field(description="the database file; it and its directory are created")
    capacity: Size = Field(
        gt=0, description="bytes of framed blocks kept; the least recently used go first"
    )
    synchronous: Literal["off", "normal", "full"] = Field(
        default="normal",
        description="SQLite's durability setting (WAL mode): normal survives a process "
        "crash, full also a power loss",
    )


def _chunks(keys: Sequence[OffloadKey]) -> Iterator[Sequence[OffloadKey]]:
    for start in range(0, len(keys), _KEYS_PER_QUERY):
        yield keys[start : start + _KEYS_PER_QUERY]


def _marks(n: int) -> str:
    return ",".join("?" * n)


class SqliteTier(SecondaryTierManager):
    """Framed blocks as rows of one table, LRU-evicted past `capacity`."""

    Config = SqliteTierConfig
    config: SqliteTierConfig
    reports_evictions = True
    protects_claims = True

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._db: sqlite3.Connection | None = None
        self._one_thread = anyio.CapacityLimiter(1)
        self._inflight = InFlightJobs(self.name)
        self._bytes = 0
        self._clock = 0
        # every row of this namespace has a key in [_ns, _ns_end): its prefix
        ns = self.framer.namespace_tag
        self._ns = ns.to_bytes(8, "big")
        self._ns_end = (ns + 1).to_bytes(9, "big")[1:] if ns < 2**64 - 1 else b"\xff" * 9

    @staticmethod
    def get_tier_type() -> str:
        return "sqlite"

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def describe(self) -> dict[str, Any]:
        return {
            "type": "sqlite",
            "path": str(self.config.path),
            "used_bytes": self._bytes,
            "capacity": int(self.config.capacity),
        }

    # -- plumbing -----------------------------------------------------------------
    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        return await in_thread(func, *args, limiter=self._one_thread)

    async def _run(
        self, job: JobMetadata, rows: Callable[[Batch, list[OffloadKey]], dict[OffloadKey, str]]
    ) -> JobResult:
        """The whole job as one batch, one thread call, one transaction; the keys that
        call removed (evicted, or deleted after a failed check) are reported after it."""
        removed: list[OffloadKey] = []
        verb = "store" if rows == self.store_rows else "load"

        async def work(batch: Batch) -> dict[OffloadKey, str]:
            try:
                return await self._in_thread(rows, batch, removed)
            except sqlite3.Error as exc:
                return {key: f"sqlite {verb} failed: {exc}" for key, _slot in batch}
            finally:
                self.report_removed(removed)

        async with self._inflight.job():
            return await run_job(
                job,
                work,
                label=f"sqlite {verb}",
                concurrency=1,
                timeout=self.config.job_timeout,
                batches=[list(zip(job.keys, job.slots))] if job.keys else [],
            )

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise TierUnavailable(f"sqlite tier {self.config.path} is not open")
        return self._db

    def _check_open(self) -> None:
        if self._db is None or self._inflight.closing:
            raise TierUnavailable(f"sqlite tier {self.config.path} is not open")

    @contextmanager
    def _transaction(self, db: sqlite3.Connection) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT; on any error ROLLBACK and re-read the counters,
        which the failed transaction may have moved."""
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            self._read_counters(db)
            raise

    def _row(self, key: OffloadKey) -> bytes:
        """The stored key of `key`: the namespace prefix, then the key."""
        return self._ns + key

    def _rows(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        return [self._ns + key for key in keys]

    def _read_counters(self, db: sqlite3.Connection) -> None:
        (size,) = db.execute(
            "SELECT COALESCE(SUM(LENGTH(frame)), 0) FROM blocks WHERE key >= ? AND key < ?",
            (self._ns, self._ns_end),
        ).fetchone()
        (clock,) = db.execute("SELECT COALESCE(MAX(used), 0) FROM blocks").fetchone()
        self._bytes, self._clock = int(size), int(clock)

    def _evict(
        self,
        db: sqlite3.Connection,
        evicted: list[OffloadKey] | None = None,
        need: int = 0,
        keep: OffloadKey | None = None,
    ) -> bool:
        """Delete the least recently used rows, passing over claimed ones and `keep`,
        until the rest and `need` more bytes fit `capacity`; append their keys to
        `evicted`. Whether they fit."""
        capacity = int(self.config.capacity) - need
        after = -1  # rows are walked in `used` order, past the ones passed over
        while self._bytes > capacity:
            rows = db.execute(
                "SELECT key, LENGTH(frame), used FROM blocks WHERE key >= ? AND key < ? "
                "AND used > ? ORDER BY used LIMIT 64",
                (self._ns, self._ns_end, after),
            ).fetchall()
            if not rows:
                return False
            for row, size, used in rows:
                after = used
                if self._bytes <= capacity:
                    break
                key = bytes(row[len(self._ns) :])
                if key == keep or self.claims.is_protected(key):
                    continue
                db.execute("DELETE FROM blocks WHERE key = ?", (row,))
                self._bytes -= size
                if evicted is not None:
                    evicted.append(key)
        return True

    # -- life cycle ---------------------------------------------------------------
    async def open(self) -> None:
        try:
            await self._in_thread(self._open_db)
        except (OSError, sqlite3.Error) as exc:
            raise TierUnavailable(
                f"sqlite tier cannot open {self.config.path}: {exc}; check that `path` "
                "names a file tierkv may create and write"
            ) from exc

    def _open_db(self) -> None:
        self._private_file()
        db = sqlite3.connect(self.config.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.config.synchronous.upper()}")
            db.executescript(_SCHEMA)
            self._read_counters(db)
            with self._transaction(db):
                self._evict(db)  # the capacity may be smaller than last time
        except BaseException:
            db.close()
            raise
        self._db = db

    def _private_file(self) -> None:
        """The database file, made 0600 whatever the umask (its `-wal` and `-shm` files
        take its mode), in a directory only the server's user may write: blocks encode
        prompts (tierkv's private-directory rule, `tierkv.tier.directory_problem`).
        Missing directories are made 0700. Raises TierUnavailable, saying how to fix
        it, for a directory others may write or own, or a database file another user
        owns."""
        path = self.config.path
        make_directories(path.parent)
        problem = directory_problem(path.parent, os.stat(path.parent))
        if problem is not None:
            raise TierUnavailable(f"sqlite tier: {problem}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise TierUnavailable(
                    f"sqlite tier: {path} belongs to uid {st.st_uid}, not to the server's "
                    f"uid {os.geteuid()}: point `path` at a database of your own"
                )
            if stat.S_IMODE(st.st_mode) != FILE_MODE:  # made under a wide umask before
                os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)

    async def close(self) -> None:
        await self._inflight.drain()
        self.claims.clear()
        if self._db is not None:
            db, self._db = self._db, None
            await self._in_thread(db.close)

    # -- the contract -------------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        try:
            held = await self._in_thread(self._held, list(keys))
        except sqlite3.Error as exc:
            raise TierUnavailable(f"sqlite lookup failed: {exc}") from exc
        return [key in held for key in keys]

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        if self._db is None or self._inflight.closing or not keys:
            return
        with contextlib.suppress(sqlite3.Error):  # best effort: recency only
            await self._in_thread(self._touch, list(keys))

    def _touch(self, keys: list[OffloadKey]) -> None:
        db = self._conn()
        with self._transaction(db):
            for key in keys:
                self._clock += 1
                db.execute(
                    "UPDATE blocks SET used = ? WHERE key = ?", (self._clock, self._row(key))
                )

    def _held(self, keys: list[OffloadKey]) -> set[OffloadKey]:
        db = self._conn()
        held: set[OffloadKey] = set()
        for chunk in _chunks(keys):
            sql = f"SELECT key FROM blocks WHERE key IN ({_marks(len(chunk))})"
            held.update(row[0][len(self._ns) :] for row in db.execute(sql, self._rows(chunk)))
        return held

    async def store(self, job: JobMetadata) -> JobResult:
        self._check_open()
        return await self._run(job, self.store_rows)

    def store_rows(self, batch: Batch, removed: list[OffloadKey]) -> dict[OffloadKey, str]:
        """Worker thread: one transaction storing `batch`; evicted keys go to `removed`."""
        db = self._conn()
        failed: dict[OffloadKey, str] = {}
        capacity = int(self.config.capacity)
        evicted: list[OffloadKey] = []
        with self._transaction(db):
            for key, slot in batch:
                frame = self.framer.encode(key, self.primary.block(slot))
                if len(frame) > capacity:
                    failed[key] = f"a block frame of {len(frame)} bytes exceeds the capacity"
                    continue
                old = db.execute(
                    "SELECT LENGTH(frame) FROM blocks WHERE key = ?", (self._row(key),)
                )
                row = old.fetchone()
                if not self._evict(db, evicted, len(frame) - (row[0] if row else 0), key):
                    failed[key] = (
                        f"{NO_ROOM}: the sqlite tier is full of blocks claimed by lookups "
                        "until their loads (or claim_lease) end"
                    )
                    continue
                self._clock += 1
                db.execute(
                    "INSERT INTO blocks (key, frame, used) VALUES (?, ?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET frame = excluded.frame, used = excluded.used",
                    (self._row(key), frame, self._clock),
                )
                self._bytes += len(frame) - (row[0] if row else 0)
        removed.extend(evicted)  # only once the transaction committed
        return failed

    async def load(self, job: JobMetadata) -> JobResult:
        self._check_open()
        return await self._run(job, self.load_rows)

    def load_rows(self, batch: Batch, removed: list[OffloadKey]) -> dict[OffloadKey, str]:
        """Worker thread: read and check `batch` into its slots; keys deleted after a
        failed check go to `removed`."""
        db = self._conn()
        keys = [key for key, _slot in batch]
        frames: dict[OffloadKey, bytes] = {}
        for chunk in _chunks(keys):
            sql = f"SELECT key, frame FROM blocks WHERE key IN ({_marks(len(chunk))})"
            for row, frame in db.execute(sql, self._rows(chunk)):
                frames[row[len(self._ns) :]] = frame
        failed: dict[OffloadKey, str] = {}
        corrupt: list[OffloadKey] = []
        with self._transaction(db):
            for key, slot in batch:
                frame = frames.get(key)
                if frame is None:
                    failed[key] = "not in the sqlite tier"
                    continue
                try:
                    self.framer.decode_into(key, frame, self.primary.block(slot))
                except CorruptBlock as exc:
                    db.execute("DELETE FROM blocks WHERE key = ?", (self._row(key),))
                    self._bytes -= len(frame)
                    failed[key] = f"corrupt block deleted: {exc}"
                    corrupt.append(key)
                    continue
                self._clock += 1
                db.execute(
                    "UPDATE blocks SET used = ? WHERE key = ?", (self._clock, self._row(key))
                )
        removed.extend(corrupt)
        return failed

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        self._check_open()
        if not keys:
            return
        async with self._inflight.job():
            await self._in_thread(self._delete_rows, list(keys))

    def _delete_rows(self, keys: list[OffloadKey]) -> None:
        db = self._conn()
        with self._transaction(db):
            for chunk in _chunks(self._rows(keys)):
                marks = _marks(len(chunk))
                sizes = db.execute(
                    f"SELECT LENGTH(frame) FROM blocks WHERE key IN ({marks})", chunk
                ).fetchall()
                db.execute(f"DELETE FROM blocks WHERE key IN ({marks})", chunk)
                self._bytes -= sum(size for (size,) in sizes)
