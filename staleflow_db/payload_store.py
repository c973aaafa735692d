"""The payload store: finished segments' payloads moved out of the database into objects.

A finished segment (its sample aborted, or its group consumed: trained) never changes again
and is read only by the audit, the export and ad hoc analysis, so its packed token ids and
log-probs (`payloads`) can live in an object store while the row keeps the metadata and
lineage: `segments.payload_object` (a `payload_objects` row: the object's URL, size and
SHA-256) and `segments.payload_offset`; the segment's bytes are
`[offset, offset + 8 * n_tokens)` of that object, its tokens then its log-probs.

The store is a folder (`file://`, the default: `$STALEFLOW_HOME/payloads`) or any
S3-compatible store (`s3://bucket/prefix`, through fsspec + s3fs: the `store` extra), named by
`STALEFLOW_PAYLOAD_STORE` or per call (`staleflow offload RUN --store URL`); an S3 endpoint
other than AWS's comes from `STALEFLOW_PAYLOAD_STORE_ENDPOINT`, credentials from the usual AWS
chain (AWS_ACCESS_KEY_ID ..., ~/.aws). Each row names its object's full URL, so a run's
objects stay readable after the setting changes.

`offload_run` is idempotent and crash-safe: each batch is written as a new object first, then
one transaction records it and sets the batch's payloads to NULL (the one update the segments'
append-only trigger allows, migration 0015). A crash between the two leaves an unreferenced
object and the rows as they were; the next run writes them again.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine

from . import payloads, queries

BATCH_SEGMENTS = 4000  # segments per object
BATCH_BYTES = 16 << 20  # and at most about this many bytes: the transaction is open during the upload


class PayloadStoreError(Exception):
    """An object that cannot be written or read back as recorded."""


def default_url() -> str:
    from .settings import get_settings

    s = get_settings()
    return s.payload_store or (s.home / "payloads").resolve().as_uri()


def _options(url: str) -> dict[str, Any]:
    if url.startswith(("s3://", "s3a://")):
        from .settings import get_settings

        endpoint = get_settings().payload_store_endpoint
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    if url.startswith("file://"):
        return {"auto_mkdir": True}
    return {}


def _fs(url: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise PayloadStoreError("the payload store needs fsspec (pip install 'staleflow[store]')") from None
    try:
        fs, path = url_to_fs(url, **_options(url))
    except (ImportError, ValueError) as e:
        raise PayloadStoreError(f"payload store {url}: {e}") from None
    return fs, str(path)


@dataclass
class PayloadStore:
    """Where `offload_run` writes new objects: the folder or bucket prefix `url`."""

    url: str
    _fs: Any = field(init=False, repr=False)
    _root: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._fs, self._root = _fs(self.url)

    def put(self, key: str, data: bytes) -> str:
        """Write a new object; its full URL."""
        try:
            self._fs.pipe_file(f"{self._root}/{key}", data)
        except OSError as e:
            raise PayloadStoreError(f"cannot write {self.url}/{key}: {e}") from e
        return f"{self.url}/{key}"


def open_store(url: str | None = None) -> PayloadStore:
    return PayloadStore(url or default_url())


def read_object(url: str, size: int, sha256: str) -> bytes:
    """An object's bytes, checked against its recorded size and SHA-256."""
    fs, path = _fs(url)
    try:
        data = fs.cat_file(path)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        raise PayloadStoreError(f"cannot read {url}: {e}") from e
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise PayloadStoreError(f"{url}: not the object recorded ({len(data)} bytes, SHA-256 differs or size {size})")
    return bytes(data)


class ObjectCache:
    """Objects read by one reader (an export page, the audit), each fetched and checked once."""

    def __init__(self) -> None:
        self._got: dict[str, bytes] = {}

    def get(self, url: str, size: int, sha256: str) -> bytes:
        if url not in self._got:
            self._got[url] = read_object(url, size, sha256)
        return self._got[url]

    def segment(self, url: str, size: int, sha256: str, offset: int, n_tokens: int) -> tuple[bytes, bytes]:
        """The packed (token ids, log-probs) of the segment at `offset` of the object."""
        data = self.get(url, size, sha256)
        end = offset + 2 * payloads.WIDTH * n_tokens
        if offset < 0 or end > len(data):
            raise PayloadStoreError(f"bytes {offset}..{end} lie outside {url} ({len(data)} bytes)")
        return payloads.unpack_object(data[offset:end], n_tokens)


@dataclass
class Offloaded:
    objects: int = 0
    segments: int = 0
    bytes: int = 0


def offload_run(engine: Engine, store: PayloadStore, run_id: int, max_objects: int | None = None) -> Offloaded:
    """Move the payloads of the run's finished segments into `store`, one object per batch,
    until none is left (or `max_objects` were written)."""
    done = Offloaded()
    while max_objects is None or done.objects < max_objects:
        with engine.begin() as conn:
            batch = _offload_batch(conn, store, run_id)
        if batch is None:
            break
        done.objects, done.segments, done.bytes = done.objects + 1, done.segments + batch[0], done.bytes + batch[1]
    return done


def _offload_batch(conn: Connection, store: PayloadStore, run_id: int) -> tuple[int, int] | None:
    """One object: write it, then record it and point the segments at it (this transaction)."""
    rows = conn.execute(
        queries.text("offload_candidates"), {"run": run_id, "n": BATCH_SEGMENTS, "max_bytes": BATCH_BYTES}
    ).all()
    if not rows:
        return None
    parts, offsets, at = [], [], 0
    for r in rows:
        part = payloads.pack_object(r.token_ids, r.logprobs)
        parts.append(part)
        offsets.append(at)
        at += len(part)
    data = b"".join(parts)
    url = store.put(f"run-{run_id}/{rows[0].sample_id}-{uuid.uuid4().hex}.seg", data)  # the object first
    conn.execute(
        queries.text("offload_record"),
        {
            "run": run_id,
            "url": url,
            "size": len(data),
            "sha": hashlib.sha256(data).hexdigest(),
            "sids": [r.sample_id for r in rows],
            "seqs": [r.seq for r in rows],
            "offs": offsets,
        },
    )
    return len(rows), len(data)


def payload_violations(conn: Connection, run_id: int) -> list[dict[str, str]]:
    """The audit's payload checks on offloaded segments, read through the store: each object
    reads back as recorded (size, SHA-256), each segment's byte range lies inside it, and an
    observation's log-probs are 0 (as `turn_violations` checks for the rows that hold theirs)."""
    rows = conn.execute(queries.text("audit_offloaded_segments"), {"r": run_id}).all()
    found: list[dict[str, str]] = []
    cache, unreadable = ObjectCache(), set()
    for r in rows:
        if r.url in unreadable:
            continue
        try:
            cache.get(r.url, r.size_bytes, r.sha256)
        except PayloadStoreError as e:
            unreadable.add(r.url)
            found.append({"invariant": "payload", "subject": f"object {r.object_id}", "detail": str(e)})
            continue
        subject = f"sample {r.sample_id}"
        try:
            _, logprobs = cache.segment(r.url, r.size_bytes, r.sha256, r.payload_offset, r.n_tokens)
        except (PayloadStoreError, ValueError) as e:
            found.append({"invariant": "payload", "subject": subject, "detail": f"segment {r.seq}: {e}"})
            continue
        if not r.generated and logprobs.strip(b"\x00"):
            found.append(
                {
                    "invariant": "observation",
                    "subject": subject,
                    "detail": f"observation segment {r.seq}: log-probs are not 0 (it was not sampled)",
                }
            )
    return found


def fill_offloaded(rows: Iterable[dict[str, Any]]) -> None:
    """Export rows (`export_samples`): each offloaded segment's packed payload read through its
    object, in place of the NULL the row holds."""
    cache = ObjectCache()
    for row in rows:
        urls = row["seg_urls"]
        for k, url in enumerate(urls):
            if url is None:
                continue
            t, lp = cache.segment(
                url, row["seg_sizes"][k], row["seg_sums"][k], row["seg_offsets"][k], row["seg_lengths"][k]
            )
            row["seg_tokens"][k], row["seg_logprobs"][k] = t, lp
