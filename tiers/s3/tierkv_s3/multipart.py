"""Multipart stores of the `s3` tier, and the incomplete uploads they may leave at S3.

A frame of at least 2 x `part_size` goes up as a multipart upload, its parts up to
`max_concurrency` at once. S3 keeps (and bills) the parts of an upload nobody
completes or aborts, so every way out of a store but success aborts its upload, and
one the abort could not reach is kept and aborted again by `clean_up` (the tier's
`close`). A `CreateMultipartUpload` that timed out may still have created an upload
at S3 after the client gave up (and with `retries`, even when the store then
succeeds): its object is swept, listing the uploads of that object
(`ListMultipartUploads`) and aborting every one but those in progress here, right
after the store and again at `clean_up`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from s3fs import S3FileSystem  # type: ignore[import-untyped]

from tierkv.tier import OffloadKey
from tierkv_s3.names import ObjectNames
from tierkv_s3.retry import JOB_WIDE, S3Failure, call_with_retries

logger = logging.getLogger(__name__)

Call = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""The tier's retry policy: `call(what, attempt)` retried as its config says."""

ABORT_GRACE = 2.0
"""Seconds a cancelled store may spend aborting its multipart upload before it returns
(an abort not confirmed by then is retried by `clean_up`)."""


class MultipartUploads:
    """One tier's multipart stores and the uploads left to abort; see the module doc."""

    def __init__(
        self, names: ObjectNames, part_size: int, max_concurrency: int, call: Call
    ) -> None:
        self._names = names
        self._part_size = part_size
        self._max_concurrency = max_concurrency
        self._call = call
        self.unaborted: list[tuple[str, str]] = []  # (object key, upload id)
        self.unswept: set[str] = set()  # object keys whose upload create timed out
        self.uploading: set[str] = set()  # upload ids of multipart stores in flight

    async def clean_up(self, fs: S3FileSystem, timeout: float) -> None:
        """Abort what stores could not (the tier is closing): uploads a cancelled store
        left, then those a timed-out create may have left."""
        leftover, self.unaborted = self.unaborted, []
        for name, upload_id in leftover:
            await self.abort(fs, name, upload_id, timeout)
        suspects, self.unswept = sorted(self.unswept), set()
        for name in suspects:
            await self.sweep(fs, name, timeout)

    async def put(
        self, fs: S3FileSystem, key: OffloadKey, frame: bytes, request_timeout: float
    ) -> None:
        """Upload `frame` in parts of `part_size`, up to `max_concurrency` at once.

        Not s3fs's `_pipe_file`: it aborts the upload only on an `Exception`, so a
        cancellation (a request or job timeout, the cache closing) left an incomplete
        multipart upload whose parts S3 keeps, and bills, until someone aborts it.
        Here any way out but success aborts it; one the abort could not reach is kept
        and aborted again by `clean_up`."""
        bucket, name, url = self._names.bucket, self._names.key(key), self._names.url(key)
        part_size = self._part_size
        attempts = 0

        async def create() -> Any:
            nonlocal attempts
            attempts += 1
            return await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=name)

        try:
            created = await self._call(f"store of {url}", create)
        except BaseException as exc:
            if attempts and not (isinstance(exc, S3Failure) and exc.kind in JOB_WIDE):
                self.unswept.add(name)  # an attempt may have created an upload anyway
                with anyio.CancelScope(shield=True):
                    await self.sweep(fs, name, ABORT_GRACE)
            raise
        upload_id: str = created["UploadId"]
        if attempts > 1:  # an earlier attempt timed out, and may yet create an upload
            self.unswept.add(name)
        self.uploading.add(upload_id)
        try:
            starts = range(0, len(frame), part_size)
            etags = [""] * len(starts)
            failures: list[S3Failure] = []
            limiter = anyio.CapacityLimiter(self._max_concurrency)

            async def upload(index: int, start: int) -> None:
                body = frame[start : start + part_size]
                try:
                    async with limiter:
                        reply = await self._call(
                            f"store of {url} (part {index + 1})",
                            lambda: fs._call_s3(
                                "upload_part",
                                Bucket=bucket,
                                Key=name,
                                UploadId=upload_id,
                                PartNumber=index + 1,
                                Body=body,
                            ),
                        )
                except S3Failure as failure:
                    failures.append(failure)
                    tg.cancel_scope.cancel()  # the upload is lost: stop its other parts
                    return
                etags[index] = reply["ETag"]

            async with anyio.create_task_group() as tg:
                for index, start in enumerate(starts):
                    tg.start_soon(upload, index, start)
            if failures:
                raise failures[0]
            parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
            await self._call(
                f"store of {url}",
                lambda: fs._call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except BaseException:
            # shielded, so a cancellation cannot skip it; bounded, so a dead endpoint
            # delays the job's end by at most ABORT_GRACE
            with anyio.CancelScope(shield=True):
                if not await self.abort(fs, name, upload_id, ABORT_GRACE):
                    self.unaborted.append((name, upload_id))
            raise
        finally:
            self.uploading.discard(upload_id)
        if name in self.unswept:
            await self.sweep(fs, name, request_timeout)

    async def sweep(self, fs: S3FileSystem, name: str, timeout: float) -> bool:
        """Abort the incomplete multipart uploads of object `name` (except those this
        tier is running): what a `CreateMultipartUpload` that timed out on the client
        may have left at S3. Whether the listing and every abort succeeded. The name
        stays in `unswept` either way: the late create may reach S3 after this sweep,
        so `clean_up` sweeps it once more.

        An upload of the same object by another server at the same moment would be
        aborted too; its store fails and is retried by its cache: keys are content
        hashes, so that writer was storing the very bytes this tier just stored."""
        bucket = self._names.bucket
        try:
            reply = await call_with_retries(
                f"listing the uploads of s3://{bucket}/{name}",
                lambda: fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=name),
                retries=0,
                timeout=timeout,
                backoff_base=0.0,
                backoff_cap=0.0,
            )
        except S3Failure as failure:
            logger.warning("s3: %s", failure)
            return False
        swept = True
        for upload in reply.get("Uploads") or []:
            upload_id = upload.get("UploadId")
            if upload.get("Key") != name or upload_id in self.uploading:
                continue
            swept = await self.abort(fs, name, upload_id, timeout) and swept
        return swept

    async def abort(self, fs: S3FileSystem, name: str, upload_id: str, timeout: float) -> bool:
        """Abort one multipart upload; whether S3 confirmed it (or it is gone)."""
        bucket = self._names.bucket
        try:
            await call_with_retries(
                f"abort of the upload of s3://{bucket}/{name}",
                lambda: fs._call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload_id
                ),
                retries=0,
                timeout=timeout,
                backoff_base=0.0,
                backoff_cap=0.0,
            )
        except S3Failure as failure:
            if failure.kind == "missing":  # NoSuchUpload: nothing left to abort
                return True
            logger.warning("s3: %s", failure)
            return False
        return True
