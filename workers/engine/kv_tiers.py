"""Host memory and local disk under the device KV pool: where an evicted prefix block goes.

A cached block (full, hashed) that no sequence references is *offered* down: a background thread
copies it into a host slot (pinned memory on CUDA), and, with a disk tier, writes it through to a
file named by its hash. When the device pool hands the block out again (eviction), its copy is
already below, or is made then (``evict``); the device pool never waits for a disk. Host slots go
LRU; a block dropped from host stays on disk while the disk tier has room (LRU too). So a block
falls device -> host -> disk -> gone, and each tier announces what it gains and loses as block
events (``BlockStored``/``BlockRemoved`` with its ``medium``), which the worker publishes to the
prefix index with the device pool's own.

A waiting request whose next blocks a lower tier holds gets them *loaded*: device blocks are
taken for them and the same thread copies the KV in (host: a copy; disk: a file read, checked
against its digest) while the batch goes on; the scheduler admits the request once the load is
done, finding the blocks in the device cache like any prefix hit. Blocks are copied whole, as
bytes (a quantized block's scale row included), so a block served from any tier is the block that
was computed.

A disk file holds one block: a header (its hash, parent hash, token ids, cache salt, the cache
layout, a digest of the payload) and the payload ``[layers, 2, rows, heads, dim]``. The file name
is the hash; a restart re-reads every file and keeps it only if the hash recomputed from the
header's tokens and parent is the name, the layout is this engine's and the payload's digest
verifies, so a corrupted or truncated file is deleted, never served. Each replica takes its own
directory under ``disk_kv_path`` (the first one no live process holds an exclusive lock on), so a
restarted replica finds what its predecessor wrote.

Threading: the engine thread calls ``offer``, ``evict``, ``find``, ``load`` and ``take_events``;
one thread (``kv-tiers``) does the copies and file I/O. One lock guards the tiers' tables and
every copy out of a device block: ``evict`` takes it, so a device block is never overwritten
while the thread reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.events import DISK, HOST, BlockRemoved, BlockStored, KVEvent
from kvstore.hashing import BlockHash, hash_block
from workers.protocol import KVLayout

logger = logging.getLogger(__name__)

MAGIC = b"PDKV1\n"
_HEADER_LEN = struct.Struct("<I")
DIGEST_BYTES = 16
MAX_PENDING_WRITES = 256  # disk writes queued at most; past it a block is not written (counted)

# Job priorities of the tier thread: a waiting request's load first, then copies down.
_LOAD, _SPILL, _WRITE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What identifies a cached block anywhere: its chained hash and what it was hashed from."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(slots=True)
class TierStats:
    host_capacity: int = 0  # blocks
    disk_capacity: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0
    host_spills: int = 0  # blocks copied into host memory
    disk_spills: int = 0  # blocks written to disk
    host_hits: int = 0  # blocks loaded back from host memory
    disk_hits: int = 0  # blocks loaded back from disk
    loads: int = 0  # load jobs finished
    load_s: float = 0.0  # their seconds, summed
    host_load_s: float = 0.0  # seconds spent loading blocks from host memory, summed
    disk_load_s: float = 0.0  # from disk (read and verified)
    skipped_writes: int = 0  # blocks not written: the disk queue was full
    dropped_files: int = 0  # disk files that failed verification (start-up or load)


@dataclass(eq=False)
class LoadJob:
    """Device blocks being filled from the tiers for one waiting request."""

    metas: list[BlockMeta]
    block_ids: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    loaded: int = 0  # leading blocks whose KV is in place (set by the tier thread)
    held: list[int] = field(default_factory=list)  # device-cached blocks before them, kept meanwhile
    seconds: float = 0.0


@dataclass(slots=True)
class _DiskEntry:
    meta: BlockMeta
    path: Path


class KVTiers:
    """The host and disk tiers of one engine's KV pool (see the module docstring)."""

    def __init__(
        self,
        kv_layers: Seq[torch.Tensor],
        layout: KVLayout,
        model_key: str,
        host_blocks: int,
        disk_blocks: int = 0,
        disk_dir: str | os.PathLike | None = None,
    ) -> None:
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0 blocks")
        if disk_blocks and disk_dir is None:
            raise ValueError("a disk tier needs disk_kv_path: the directory its files go to")
        self.layers = list(kv_layers)
        self.layout = layout
        self.model_key = model_key
        first = self.layers[0]
        self.device = first.device
        self.block_shape = (len(self.layers), *first[:, 0].shape)  # [layers, 2, rows, heads, dim]
        self.dtype = first.dtype
        self.stats = TierStats(host_capacity=host_blocks, disk_capacity=disk_blocks)
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []
        # host: hash -> slot, LRU first; slots of [layers, 2, rows, heads, dim] each
        self._host: OrderedDict[BlockHash, tuple[int, BlockMeta]] = OrderedDict()
        self._host_free = list(range(host_blocks - 1, -1, -1))
        self._host_data = (
            torch.empty((host_blocks, *self.block_shape), dtype=self.dtype, pin_memory=self.device.type == "cuda")
            if host_blocks
            else None
        )
        self._disk: OrderedDict[BlockHash, _DiskEntry] = OrderedDict()
        self._writing: set[BlockHash] = set()  # disk writes queued or under way
        self._offered: dict[int, BlockHash] = {}  # device block -> hash, offered and not yet evicted
        # Copies made outside the lock: device blocks being read (``evict`` waits for them) and
        # host slots being read (never dropped meanwhile).
        self._copying: set[int] = set()
        self._reading: set[int] = set()
        self._copied = threading.Condition(self._lock)
        self._dir: Path | None = None
        self._dir_lock = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if disk_blocks:
            assert disk_dir is not None
            self._dir, self._dir_lock = _claim_directory(Path(disk_dir) / _safe_name(model_key))
            self._recover()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # jobs queued or running
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- engine thread
    @property
    def directory(self) -> Path | None:
        return self._dir

    def offer(self, block_id: int, meta: BlockMeta) -> None:
        """A cached device block nobody references: copy it down in the background."""
        with self._lock:
            if meta.block_hash in self._host or meta.block_hash in self._disk or meta.block_hash in self._writing:
                self._touch(meta.block_hash)
                return
            self._offered[block_id] = meta.block_hash
        self._submit(_SPILL, ("spill", block_id, meta))

    def evict(self, block_id: int, meta: BlockMeta) -> None:
        """The device pool reuses ``block_id`` (which holds ``meta``'s KV) now: make sure a lower
        tier has its copy before the caller overwrites it."""
        with self._lock:
            while block_id in self._copying:  # the thread is reading it right now
                self._copied.wait()
            self._offered.pop(block_id, None)
            payload = self._capture(block_id, meta)
        if payload is not None:
            self._submit(_WRITE, ("write", payload, meta))

    def find(self, metas_needed: Seq[tuple[BlockHash, tuple[int, ...]]]) -> list[BlockMeta]:
        """The leading run of (hash, tokens) that a lower tier holds, tokens verified."""
        found: list[BlockMeta] = []
        with self._lock:
            for block_hash, tokens in metas_needed:
                entry = self._host.get(block_hash)
                meta = entry[1] if entry is not None else None
                if meta is None and block_hash in self._disk:
                    meta = self._disk[block_hash].meta
                if meta is None or meta.token_ids != tokens:
                    break
                found.append(meta)
        return found

    def load(self, metas: list[BlockMeta], block_ids: list[int]) -> LoadJob:
        """Fill ``block_ids`` (taken by the caller) with ``metas``' KV in the background."""
        job = LoadJob(metas, block_ids)
        self._submit(_LOAD, ("load", job))
        return job

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def clear(self) -> None:
        """Forget every block below the device pool (files deleted)."""
        self.wait_idle()
        with self._lock:
            removed_host = tuple(self._host)
            removed_disk = tuple(self._disk)
            for entry in self._disk.values():
                entry.path.unlink(missing_ok=True)
            self._host.clear()
            self._disk.clear()
            self._offered.clear()
            self._host_free = list(range(self.stats.host_capacity - 1, -1, -1))
            if removed_host:
                self._events.append(BlockRemoved(removed_host, HOST))
            if removed_disk:
                self._events.append(BlockRemoved(removed_disk, DISK))
            self._count()

    def held(self) -> dict[str, list[BlockHash]]:
        """Hashes each lower tier holds (tests and re-announcing)."""
        with self._lock:
            return {HOST: list(self._host), DISK: list(self._disk)}

    def wait_idle(self, timeout: float | None = 30.0) -> bool:
        """Wait until no copy, load or write is queued or under way."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish queued work, stop the thread and release the disk directory."""
        if self._closed:
            return
        self._closed = True
        self.wait_idle()
        self._jobs.put((99, next(self._seq), None))
        self._thread.join(timeout=10)
        if self._dir_lock is not None:
            with contextlib.suppress(OSError):
                self._dir_lock.close()

    # --------------------------------------------------------------- internal
    def _submit(self, priority: int, job) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put((priority, next(self._seq), job))

    def _run(self) -> None:
        held_back = None  # a job taken while gathering spills, run next
        while True:
            item = held_back or self._jobs.get()
            held_back = None
            job = item[2]
            if job is None:
                return
            batch = [job]
            while job[0] == "spill":  # the spills queued now go in one batch (one copy per layer)
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt[2] is None or nxt[2][0] != "spill":
                    held_back = nxt
                    break
                batch.append(nxt[2])
            try:
                kind = job[0]
                if kind == "spill":
                    self._spill([(b[1], b[2]) for b in batch])
                elif kind == "write":
                    self._write(job[1], job[2])
                else:
                    self._load(job[1])
            except Exception:  # a failed copy loses a cached block, never a request
                logger.exception("KV tier job %s failed", job[0])
                if job[0] == "load":
                    job[1].done.set()
            finally:
                with self._idle:
                    self._pending -= len(batch)
                    if self._pending == 0:
                        self._idle.notify_all()

    def _spill(self, blocks: list[tuple[int, BlockMeta]]) -> None:
        writes = []
        with self._lock:
            # evicted meanwhile (``evict`` made the copy) or revived and offered again: skipped
            blocks = [(b, m) for b, m in blocks if self._offered.get(b) == m.block_hash]
            for block_id, _ in blocks:
                del self._offered[block_id]
            todo: list[tuple[int, BlockMeta]] = []
            slots: list[int] = []
            if self._host_data is not None:
                unique = dict((m.block_hash, (b, m)) for b, m in blocks).values()
                todo = [(b, m) for b, m in unique if m.block_hash not in self._host]
                for _ in todo:
                    if not self._host_free and not self._drop_host_lru():
                        break
                    slots.append(self._host_free.pop())
                todo = todo[: len(slots)]
                self._copying.update(b for b, _ in todo)
        copied = False
        if todo:  # outside the lock: the engine thread's offers and look-ups do not wait for it
            try:
                self._copy_out_many([b for b, _ in todo], slots)
                copied = True
            finally:
                with self._lock:  # registered before ``evict`` may look for them
                    if copied:
                        for (_, meta), slot in zip(todo, slots):
                            self._host[meta.block_hash] = (slot, meta)
                            self._events.append(BlockStored((meta.block_hash,), meta.parent_hash, HOST))
                        self.stats.host_spills += len(todo)
                        self._count()
                    else:
                        self._host_free.extend(slots)
                    self._copying.clear()
                    self._copied.notify_all()
        with self._lock:
            for block_id, meta in blocks:
                if self._host_data is not None and meta.block_hash not in self._host:
                    continue  # no host slot was free: ``evict`` copies it when the block is reused
                payload = self._capture(block_id, meta)  # in host now: the disk's bytes, if any
                if payload is not None:
                    writes.append((payload, meta))
        for payload, meta in writes:
            self._write(payload, meta)

    def _copy_out_many(self, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks ``block_ids`` (in ``_copying``) into host slots ``slots`` (taken, not yet
        in the table), one gather per layer."""
        host = self._host_data
        assert host is not None
        src = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(slots, dtype=torch.long)
        with self._on_stream():
            for layer, cache in enumerate(self.layers):
                rows = torch.index_select(cache, 1, src).transpose(0, 1)  # [n, 2, rows, heads, dim]
                host[:, layer].index_copy_(0, dst, rows.to("cpu", non_blocking=self._stream is not None))
            if self._stream is not None:
                self._stream.synchronize()

    def _capture(self, block_id: int, meta: BlockMeta) -> torch.Tensor | None:
        """Lock held: copy the device block into a host slot if there is a host tier and the
        block is not there yet; returns the bytes to write to disk, if the disk tier wants them."""
        block_hash = meta.block_hash
        if self._host_data is not None and block_hash not in self._host and (self._host_free or self._drop_host_lru()):
            slot = self._host_free.pop()
            self._copy_out(block_id, self._host_data[slot])
            self._host[block_hash] = (slot, meta)
            self._events.append(BlockStored((block_hash,), meta.parent_hash, HOST))
            self.stats.host_spills += 1
            self._count()
        if self._dir is None or block_hash in self._disk or block_hash in self._writing:
            return None
        if len(self._writing) >= MAX_PENDING_WRITES:
            self.stats.skipped_writes += 1
            return None
        self._writing.add(block_hash)
        if self._host_data is not None and block_hash in self._host:
            return self._host_data[self._host[block_hash][0]].clone()
        out = torch.empty(self.block_shape, dtype=self.dtype)
        self._copy_out(block_id, out)
        return out

    def _copy_out(self, block_id: int, out: torch.Tensor) -> None:
        with self._on_stream():
            for layer, cache in enumerate(self.layers):
                out[layer].copy_(cache[:, block_id], non_blocking=self._stream is not None)
            if self._stream is not None:
                self._stream.synchronize()

    def _copy_in(self, data: torch.Tensor, block_id: int) -> None:
        with self._on_stream():
            for layer, cache in enumerate(self.layers):
                cache[:, block_id].copy_(data[layer], non_blocking=self._stream is not None)
            if self._stream is not None:
                self._stream.synchronize()

    def _copy_in_many(self, per_layer: list[torch.Tensor], slots: list[int], block_ids: list[int]) -> None:
        """``per_layer[l]``: host slots' layer ``l`` (``[slots, 2, rows, heads, dim]``); copy slots
        ``slots`` into device blocks ``block_ids``, one gather and one scatter per layer."""
        src = torch.tensor(slots, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        with self._on_stream():
            for cache, data in zip(self.layers, per_layer):
                rows = torch.index_select(data, 0, src).transpose(0, 1)  # [2, n, rows, heads, dim]
                cache.index_copy_(1, dst, rows.to(self.device, non_blocking=self._stream is not None))
            if self._stream is not None:
                self._stream.synchronize()

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _drop_host_lru(self) -> bool:
        """Lock held: free the least recently used host slot not being read; False if none."""
        for block_hash, (slot, _) in self._host.items():
            if slot not in self._reading:
                del self._host[block_hash]
                self._host_free.append(slot)
                self._events.append(BlockRemoved((block_hash,), HOST))
                return True
        return False

    def _touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
        if block_hash in self._disk:
            self._disk.move_to_end(block_hash)

    def _write(self, payload: torch.Tensor, meta: BlockMeta) -> None:
        assert self._dir is not None
        path = self._dir / f"{meta.block_hash.hex()}.kv"
        try:
            _write_file(path, payload, meta, self.layout)
        except OSError as exc:
            logger.warning("KV block %s not written to disk: %s", meta.block_hash.hex(), exc)
            with self._lock:
                self._writing.discard(meta.block_hash)
            return
        with self._lock:
            self._writing.discard(meta.block_hash)
            while len(self._disk) >= self.stats.disk_capacity:
                old_hash, old = self._disk.popitem(last=False)
                old.path.unlink(missing_ok=True)
                self._events.append(BlockRemoved((old_hash,), DISK))
            self._disk[meta.block_hash] = _DiskEntry(meta, path)
            self._events.append(BlockStored((meta.block_hash,), meta.parent_hash, DISK))
            self.stats.disk_spills += 1
            self._count()

    def _load(self, job: LoadJob) -> None:
        started = time.monotonic()
        pairs = list(zip(job.metas, job.block_ids))
        with self._lock:  # the leading run in host memory: one batched copy per layer
            slots = []
            for meta, _ in pairs:
                entry = self._host.get(meta.block_hash)
                if entry is None:
                    break
                self._host.move_to_end(meta.block_hash)
                slots.append(entry[0])
            self._reading.update(slots)
        if slots:  # outside the lock (its slots are not dropped meanwhile)
            host = self._host_data
            assert host is not None
            try:
                self._copy_in_many([host[:, layer] for layer in range(len(self.layers))], slots, job.block_ids)
            finally:
                with self._lock:
                    self._reading.difference_update(slots)
            with self._lock:
                self.stats.host_hits += len(slots)
                self.stats.host_load_s += time.monotonic() - started
            job.loaded = len(slots)
        for meta, block_id in pairs[len(slots) :]:  # then disk, block by block
            with self._lock:
                disk = self._disk.get(meta.block_hash)
                if disk is not None:
                    self._disk.move_to_end(meta.block_hash)
            if disk is None:
                break  # dropped since ``find``: the rest is computed
            began = time.monotonic()
            data = _read_file(disk.path, self.layout, self.block_shape, self.dtype, meta.block_hash)
            if data is None:
                self._drop_bad_file(meta.block_hash, disk.path)
                break
            self._copy_in(data, block_id)
            with self._lock:
                self.stats.disk_hits += 1
                self.stats.disk_load_s += time.monotonic() - began
            job.loaded += 1
        with self._lock:
            self.stats.loads += 1
            job.seconds = time.monotonic() - started
            self.stats.load_s += job.seconds
        job.done.set()

    def _drop_bad_file(self, block_hash: BlockHash, path: Path) -> None:
        logger.warning("KV block file %s failed verification; deleted", path.name)
        path.unlink(missing_ok=True)
        with self._lock:
            if self._disk.pop(block_hash, None) is not None:
                self._events.append(BlockRemoved((block_hash,), DISK))
            self.stats.dropped_files += 1
            self._count()

    def _recover(self) -> None:
        """Start-up: keep the files of this directory that verify, oldest use first."""
        assert self._dir is not None
        for tmp in self._dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        files = sorted(self._dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        kept = 0
        for path in files:
            meta = _verify_file(path, self.layout, self.block_shape, self.dtype, self.model_key)
            if meta is None or len(self._disk) >= self.stats.disk_capacity:
                path.unlink(missing_ok=True)
                if meta is None:
                    logger.warning("KV block file %s failed verification; deleted", path.name)
                    self.stats.dropped_files += 1
                continue
            self._disk[meta.block_hash] = _DiskEntry(meta, path)
            self._events.append(BlockStored((meta.block_hash,), meta.parent_hash, DISK))
            kept += 1
        self._count()
        if files:
            logger.info("KV disk tier %s: %d blocks verified and kept of %d files", self._dir, kept, len(files))

    def _count(self) -> None:
        self.stats.host_blocks = len(self._host)
        self.stats.disk_blocks = len(self._disk)


def block_nbytes(kv_layers: Seq[torch.Tensor]) -> int:
    """Bytes one block takes over every layer, K and V (a tier slot, a file's payload)."""
    first = kv_layers[0]
    return first[:, 0].numel() * first.element_size() * len(kv_layers)


# ------------------------------------------------------------------ disk files
def _safe_name(model_key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_key)


def _claim_directory(root: Path):
    """The first ``root/rN`` no live process holds (an exclusive flock, released when the
    process dies), created if needed: a restarted replica takes its predecessor's directory."""
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        path = root / f"r{n}"
        path.mkdir(exist_ok=True)
        handle = open(path / ".lock", "a+b")  # noqa: SIM115 - held open for the process's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return path, handle
    raise AssertionError("unreachable")


def _layout_fields(layout: KVLayout) -> dict:
    return {
        "num_layers": layout.num_layers,
        "block_size": layout.block_size,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
    }


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


def _payload_bytes(payload: torch.Tensor) -> memoryview:
    return memoryview(payload.contiguous().view(torch.uint8).numpy().data).cast("B")


def _write_file(path: Path, payload: torch.Tensor, meta: BlockMeta, layout: KVLayout) -> None:
    data = _payload_bytes(payload)
    header = json.dumps(
        {
            "hash": meta.block_hash.hex(),
            "parent": meta.parent_hash.hex(),
            "tokens": list(meta.token_ids),
            "salt": meta.cache_salt,
            "layout": _layout_fields(layout),
            "bytes": len(data),
            "digest": _digest(data),
        }
    ).encode()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
        f.write(data)
    os.replace(tmp, path)  # a crash mid-write leaves a .tmp, never a short .kv


def _read_header(f) -> dict | None:
    if f.read(len(MAGIC)) != MAGIC:
        return None
    raw = f.read(_HEADER_LEN.size)
    if len(raw) != _HEADER_LEN.size:
        return None
    (size,) = _HEADER_LEN.unpack(raw)
    try:
        return json.loads(f.read(size))
    except ValueError:
        return None


def _read_file(
    path: Path, layout: KVLayout, shape: tuple[int, ...], dtype: torch.dtype, block_hash: BlockHash
) -> torch.Tensor | None:
    """The block's payload, or None if the file is not a whole, intact copy of ``block_hash``."""
    try:
        with open(path, "rb") as f:
            header = _read_header(f)
            if (
                header is None
                or header.get("hash") != block_hash.hex()
                or header.get("layout") != _layout_fields(layout)
            ):
                return None
            data = f.read()
    except OSError:
        return None
    if len(data) != header.get("bytes") or _digest(data) != header.get("digest"):
        return None
    expected = torch.empty(shape, dtype=dtype)
    if len(data) != expected.numel() * expected.element_size():
        return None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def _verify_file(
    path: Path, layout: KVLayout, shape: tuple[int, ...], dtype: torch.dtype, model_key: str
) -> BlockMeta | None:
    """The file's block if its name, header and payload agree; None otherwise."""
    try:
        block_hash = bytes.fromhex(path.stem)
        with open(path, "rb") as f:
            header = _read_header(f)
    except (OSError, ValueError):
        return None
    if header is None:
        return None
    try:
        parent = bytes.fromhex(header["parent"])
        tokens = tuple(int(t) for t in header["tokens"])
        salt = header.get("salt")
    except (KeyError, TypeError, ValueError):
        return None
    if len(tokens) != layout.block_size or hash_block(parent, tokens, model_key, salt) != block_hash:
        return None
    if _read_file(path, layout, shape, dtype, block_hash) is None:
        return None
    return BlockMeta(block_hash, parent, tokens, salt)
