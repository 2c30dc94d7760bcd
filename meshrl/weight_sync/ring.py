"""A versioned circular buffer of weight slots: the trainer publishes, generators pull the newest.

The trainer owns `slots` byte buffers, each holding one policy version packed in the layout the
generator loads, and a header row per slot and writer: (begin, end, version, checksum). Publishing
writes begin = k (k counts the writer's publishes), then the payload, then end = k, into slot
`version % slots`, and never waits for a reader. A reader takes the newest slot whose rows all have
begin == end and the same version, copies its payload into memory of its own, and reads the header
again: if a begin moved, a writer started on that slot during the copy, so the copy is thrown away (a
torn read, counted) and the reader copies the newest complete version instead, which by then is in
another slot. With checksums on, each writer also stores a CRC32 of what it wrote, and the reader
refuses (and counts) a copy that does not match it. Nothing a reader hands on is ever a view of the
trainer's memory: what it checked is what gets loaded, and no writer can change it afterwards.

The seqlock's memory ordering is explicit (meshrl/weight_sync/ordering.py): the writer issues a full
fence after `begin` and before `end`, a reader after each header read and around each payload copy,
each in the thread that does the stores or loads. Where no fence can be issued and the CPU does not
order stores by itself (not x86), every ring checksums its versions whatever it is asked.

Several writers share one ring when trainer ranks on one host each write their own rows of every
tensor (`pieces`: byte ranges of the payload, one list per writer); a reader on that host then sees
whole tensors in the ring's memory, with nothing to assemble. The first writer creates the memory,
the others map it (`attach_to`).

The memory is one anonymous shared-memory file (memfd). Readers on another host read it with
Monarch RDMA (ibverbs, or its TCP fallback), in concurrent chunks; readers on the same host map the
same file through /proc/<pid>/fd/<fd> and copy from it in a thread (off the event loop, a chunk at a
time, stopping early when the copy is abandoned or overtaken). "The same host" is decided by
`host_id`, not by the host name, which containers and test hosts may share.
"""

import asyncio
import itertools
import mmap
import os
import secrets
import socket
import threading
import zlib
from dataclasses import dataclass

import torch

from meshrl.weight_sync import RING_TRANSPORTS, WeightLayout
from meshrl.weight_sync.ordering import fence, needs_checksums

BEGIN, END, VERSION, CHECKSUM = range(4)
_PAGE = 4096
_COPY_CHUNK = 16 << 20  # a shared-memory copy checks for abandonment and overtaking between chunks


class CorruptWeightsError(RuntimeError):
    pass


class TornReadsError(RuntimeError):
    pass


def host_id() -> str:
    """What makes this process's host the one a ring's memory lives on: the same running kernel (its
    boot id) and the same network and process namespaces. Two containers or pods on one machine, or
    test hosts in their own network namespaces, differ here even with one host name; so do two
    machines, whose boot ids differ."""
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    return f"{boot}/net:{os.stat('/proc/self/ns/net').st_ino}/pid:{os.stat('/proc/self/ns/pid').st_ino}"


def same_host(host: str, pid: int, fd: int) -> bool:
    """Whether a ring published from `host` (its `host_id`) by process `pid` can be mapped here."""
    return host == host_id() and os.path.exists(f"/proc/{pid}/fd/{fd}")


def checksum(payload: torch.Tensor) -> int:
    return zlib.crc32(memoryview(payload.numpy()))


class SharedMemory:
    """A memfd mapping: freed by the kernel when the last process holding it exits, even on a crash."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes
        self.mmap = mmap.mmap(fd, nbytes)
        self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)

    def region(self) -> tuple[int, int, int]:
        """(pid, fd, nbytes): what another process of this host needs to map this memory (`attach`)."""
        return os.getpid(), self.fd, self.nbytes

    @staticmethod
    def create(nbytes: int) -> "SharedMemory":
        fd = os.memfd_create("meshrl-weight-ring")
        os.ftruncate(fd, nbytes)
        return SharedMemory(fd, nbytes)

    @staticmethod
    def attach(pid: int, fd: int, nbytes: int) -> "SharedMemory":
        return SharedMemory(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR), nbytes)


def _header_bytes(slots: int, writers: int) -> int:
    return 8 * (1 + 4 * slots * writers)  # a token, then a row of four int64 per slot and writer


def _slot_offsets(slots: int, writers: int, payload_bytes: int) -> list[int]:
    """Where each slot's payload starts, page-aligned, after the header; the last entry is the total size."""
    first = -(-_header_bytes(slots, writers) // _PAGE) * _PAGE
    stride = -(-payload_bytes // _PAGE) * _PAGE
    return [first + i * stride for i in range(slots + 1)]


def _regions(memory: torch.Tensor, slots: int, writers: int, payload_bytes: int):
    """The ring's memory as (token, header [slots, writers, 4], each slot's payload)."""
    token = memory[:8].view(torch.int64)
    header = memory[8:_header_bytes(slots, writers)].view(torch.int64).view(slots, writers, 4)
    payloads = [memory[o:o + payload_bytes] for o in _slot_offsets(slots, writers, payload_bytes)[:-1]]
    return token, header, payloads


Pieces = list[list[tuple[str, int, int]]]  # per writer: (tensor name, first byte, end byte) of the payload


def complete_versions(header: list[list[list[int]]]) -> dict[int, int]:
    """version -> slot, for the slots of `header` (per slot, a [begin, end, version, checksum] row per writer)
    that every writer has completely written, with one version."""
    return {rows[0][VERSION]: slot for slot, rows in enumerate(header)
            if all(row[BEGIN] == row[END] > 0 and row[VERSION] == rows[0][VERSION] for row in rows)}


def _crc(payload: torch.Tensor, pieces: list[tuple[str, int, int]] | None, kind: str = "crc32") -> int:
    """A writer's checksum (`checksum_of`) of the whole payload, or of its pieces of it in order."""
    return checksum_of([payload] if pieces is None else [payload[lo:hi] for _, lo, hi in pieces], kind)


def checksum_of(views: list[torch.Tensor], kind: str = "crc32") -> int:
    """One checksum of flat bytes in order: CRC32 (the host ring's, and a device ring's on the CPU), or "words"
    (a device ring's on CUDA, computed where the bytes lie: `word_sum` of each, combined in order)."""
    total = 0
    for view in views:
        if kind == "words":
            total = (total * 1_000_003 + word_sum(view)) & ((1 << 62) - 1)
        else:
            total = zlib.crc32(memoryview(view.numpy()), total)
    return total


def word_sum(payload: torch.Tensor) -> int:
    """The int64 sum of flat bytes' 32-bit words (order-free: the same however a GPU reduces), from the first
    4-byte-aligned one (a piece may start at any even byte), plus the single bytes before and after them."""
    head = min(-payload.data_ptr() % 4, payload.numel())
    body = (payload.numel() - head) // 4 * 4
    words = payload[head:head + body].view(torch.int32).sum(dtype=torch.int64)
    edges = payload[:head].sum(dtype=torch.int64) + payload[head + body:].sum(dtype=torch.int64) * 257
    return int(words) + int(edges)


@dataclass
class RingHandle:
    """What a reader needs to attach to a ring: picklable, passed between actors."""

    layout: WeightLayout
    slots: int
    host: str  # the trainer's host_id()
    hostname: str
    pid: int
    fd: int
    token: int  # proves a same-host reader mapped this ring and not another process's file
    header: object  # RDMABuffer over the token and header bytes
    chunks: list  # per slot, RDMABuffers over consecutive chunks of its payload
    checksums: bool
    pieces: Pieces | None = None  # each writer's part of the payload; None: one writer writes it all
    ranks: tuple[int, int] = (0, 1)  # the trainer ranks [first, end) whose rows the ring holds
    world: int = 1  # of all the trainer's ranks
    checksum_kind: str = "crc32"  # how the writers sum their pieces (`_crc`): "words" for a ring in GPU memory

    @property
    def writers(self) -> int:
        return 1 if self.pieces is None else len(self.pieces)


class WeightRing:
    """Trainer side: `publish` packs the weights (all of them, or this writer's pieces) into the next
    slot and returns at once."""

    def __init__(self, layout: WeightLayout, slots: int = 2, chunk_mb: int = 16, checksums: bool = False,
                 pieces: Pieces | None = None, ranks: tuple[int, int] = (0, 1), world: int = 1,
                 writer: int = 0, attach_to: tuple[int, int, int] | None = None, register: bool = True):
        """The first writer creates the ring; writer k > 0 maps it, given the first's `attach_info()`,
        and has no handle of its own (readers read the ring through the first's). `register` False: no
        handle at all (no Monarch RDMA buffers; a ring timed in one process, meshrl/weight_sync/staging.py)."""
        if slots < 2:
            raise ValueError("a weight ring needs at least 2 slots, so readers never race the only copy")
        # where the seqlock's order cannot be enforced (no fence, not x86), only a checksum catches a torn copy
        self.layout, self.slots, self.checksums = layout, slots, checksums or needs_checksums()
        self.pieces, self.writer = pieces, writer
        writers = 1 if pieces is None else len(pieces)
        size = _slot_offsets(slots, writers, layout.nbytes)[-1]
        if attach_to is None:
            self.memory = SharedMemory.create(size)
        else:
            self.memory = SharedMemory.attach(attach_to[0], attach_to[1], size)
        token, self.header, self.payloads = _regions(self.memory.tensor, slots, writers, layout.nbytes)
        if attach_to is None:
            token.fill_(secrets.randbits(62))
        elif int(token) != attach_to[2]:
            raise RuntimeError(f"process {attach_to[0]}'s weight ring is not on this host")
        self.token = int(token)
        self.dtypes = {spec.name: spec.dtype for spec in layout.specs}
        self.publishes = 0
        self._handle = None if writer or not register else self._register(chunk_mb << 20, ranks, world)

    def _register(self, chunk: int, ranks: tuple[int, int], world: int) -> RingHandle:
        from monarch.rdma import RDMABuffer

        header = self.memory.tensor[:_header_bytes(self.slots, self.header.shape[1])]
        return RingHandle(
            layout=self.layout, slots=self.slots, host=host_id(), hostname=socket.gethostname(), pid=os.getpid(),
            fd=self.memory.fd, token=self.token, header=RDMABuffer(header),
            chunks=[[RDMABuffer(p[i:i + chunk]) for i in range(0, self.layout.nbytes, chunk)] for p in self.payloads],
            checksums=self.checksums, pieces=self.pieces, ranks=ranks, world=world)

    def attach_info(self) -> tuple[int, int, int]:
        """(pid, fd, token): what another writer on this host needs to map this ring."""
        return os.getpid(), self.memory.fd, self.token

    def handle(self) -> RingHandle | None:
        return self._handle

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Write `version` into its slot, seqlock style; call it from one thread at a time (the fences order
        that thread's stores, and those of the worker threads its torch ops joined)."""
        slot = version % self.slots
        self.publishes += 1
        row, payload = self.header[slot, self.writer], self.payloads[slot]
        row[BEGIN] = self.publishes
        fence()  # begin is visible before any byte of the new payload
        mine = None if self.pieces is None else self.pieces[self.writer]
        if mine is None:
            self.layout.pack(weights, payload)
        else:
            for name, lo, hi in mine:
                payload[lo:hi].view(self.dtypes[name]).copy_(weights[name].reshape(-1))
        row[VERSION] = version
        row[CHECKSUM] = _crc(payload, mine) if self.checksums else 0
        fence()  # the payload, version and checksum are visible before end says the slot is complete
        row[END] = self.publishes


def choose_transport(handle: RingHandle, transport: str) -> str:
    """Shared memory when the reader is on the trainer's host and can map its ring, else RDMA."""
    if transport not in RING_TRANSPORTS:
        raise ValueError(f"weight_sync.transport must be one of {RING_TRANSPORTS}, not {transport!r}")
    if transport != "auto":
        return transport
    return "shm" if same_host(handle.host, handle.pid, handle.fd) else "rdma"


class RingReader:
    """Generator side: one ring's reader; `pull_together` reads the newest version complete in every reader's
    ring (meshrl/weight_sync/shards.py's ShardedReader holds a run's readers), never a torn one."""

    def __init__(self, handle: RingHandle, expected: WeightLayout, transport: str = "auto"):
        handle.layout.check_matches(expected)
        self.handle, self.layout = handle, expected
        self.transport = choose_transport(handle, transport)
        # this reader's copy of a version, in shared memory of its own: vLLM's tensor-parallel workers map it
        # (meshrl/weight_sync/handoff.py)
        self.copy = SharedMemory.create(max(expected.nbytes, 1))
        self.bytes = self.copy.tensor[:expected.nbytes]
        self.header_bytes = torch.empty(_header_bytes(handle.slots, handle.writers), dtype=torch.uint8)
        self.torn_reads = 0  # copies thrown away because the slot was rewritten meanwhile
        self.corrupt_reads = 0  # copies the seqlock passed but the checksum refused (should stay 0)
        self.bytes_read = 0  # payload bytes copied out of the ring, torn copies included (headers not counted)
        self.copying = threading.Lock()  # one thread at a time writes `bytes` (an abandoned copy stops first)
        if self.transport == "shm":
            if needs_checksums() and not handle.checksums:
                raise RuntimeError("this CPU does not order the ring's stores and loads and no fence can be issued "
                                   "here (libatomic is missing): set weight_sync.checksums=true")
            size = _slot_offsets(handle.slots, handle.writers, expected.nbytes)[-1]
            self.memory = SharedMemory.attach(handle.pid, handle.fd, size)
            token, self.rows, self.payloads = _regions(self.memory.tensor, handle.slots, handle.writers,
                                                       expected.nbytes)
            if int(token) != handle.token:
                raise RuntimeError(f"the shared-memory weight ring of {handle.hostname} (pid {handle.pid}) is not "
                                   "this host's: use weight_sync.transport=rdma")
        else:
            # a slot's chunks, one after another (the same sizes in every slot; a device ring's follow its segments)
            starts = itertools.accumulate((c.size() for c in handle.chunks[0]), initial=0)
            self.chunk_views = [self.bytes[lo:lo + c.size()] for lo, c in zip(starts, handle.chunks[0])]

    def check_sum(self, rows: list[list[int]]) -> bool:
        """Whether this reader's copy matches each writer's checksum in its slot's `rows` (always, without
        checksums); a mismatch is counted."""
        pieces = self.handle.pieces or [None]
        with self.copying:  # not while an abandoned copy still writes
            kind = self.handle.checksum_kind
            if not self.handle.checksums or all(_crc(self.bytes, p, kind) == row[CHECKSUM]
                                                for p, row in zip(pieces, rows)):
                return True
        self.corrupt_reads += 1  # torn in a way the seqlock missed: never loaded
        return False

    async def read_header(self) -> list[list[list[int]]]:
        """A copy of the header: per slot, one [begin, end, version, checksum] row per writer."""
        if self.transport == "shm":
            return self.header_now()
        await self.handle.header.read_into(self.header_bytes)
        return self.header_bytes[8:].view(torch.int64).view(self.handle.slots, self.handle.writers, 4).tolist()

    def header_now(self) -> list[list[list[int]]]:
        """Over shared memory: the header as it is now (each field one 8-byte load), fenced from what follows."""
        rows = self.rows.tolist()
        fence()
        return rows

    async def read_payload(self, slot: int, begins: list[int], cancel: threading.Event) -> bool:
        """Copy `slot`'s payload into this reader's own memory; False if the copy stopped early because a writer
        started on the slot (its `begins` moved). Over shared memory in a thread, a chunk at a time, stopping
        once `cancel` is set; over RDMA as concurrent reads of its chunks (each its own stream: faster than
        one batched RDMAAction over Monarch's TCP fallback)."""
        if self.transport == "shm":
            return await asyncio.to_thread(self._copy, slot, begins, cancel)
        await asyncio.gather(*(src.read_into(dst) for src, dst in zip(self.handle.chunks[slot], self.chunk_views)))
        self.bytes_read += self.layout.nbytes
        return True

    def _copy(self, slot: int, begins: list[int], cancel: threading.Event) -> bool:
        with self.copying:
            fence()  # the header's loads are done before the payload's
            source = self.payloads[slot]
            for lo in range(0, source.numel(), _COPY_CHUNK):
                if cancel.is_set():
                    return False
                self.bytes[lo:lo + _COPY_CHUNK].copy_(source[lo:lo + _COPY_CHUNK])
                self.bytes_read += min(_COPY_CHUNK, source.numel() - lo)
                fence()  # the chunk's loads are done before begin is looked at again
                if self.rows[slot, :, BEGIN].tolist() != begins:
                    return False  # overtaken: the rest would be thrown away
            return True


async def newest_together(readers: list[RingReader]) -> int:
    """The newest version completely written in every reader's ring, from their headers alone (-1: none)."""
    newest = _newest_common(readers, await asyncio.gather(*(r.read_header() for r in readers)), -1)
    return -1 if newest is None else newest[0]


def _newest_common(readers: list[RingReader], headers: list[list[list[int]]], newer_than: int):
    """(version, each reader's slot holding it) for the newest version complete in every ring and newer
    than `newer_than`, or None."""
    complete = [complete_versions(header) for header in headers]
    common = set(complete[0]).intersection(*complete[1:])
    if not common or max(common) <= newer_than:
        return None
    version = max(common)
    return version, [versions[version] for versions in complete]


def _torn(readers: list[RingReader], before: list, after: list, slots: list[int]) -> bool:
    """Whether a writer started on any reader's slot between its headers `before` and `after` (each such
    read counted as torn)."""
    torn = [r for r, b, a, slot in zip(readers, before, after, slots)
            if [row[BEGIN] for row in a[slot]] != [row[BEGIN] for row in b[slot]]]
    for r in torn:
        r.torn_reads += 1
    return bool(torn)


async def pull_together(readers: list[RingReader], newer_than: int,
                        max_attempts: int) -> tuple[int, list[list[tuple[str, torch.Tensor]]]] | None:
    """The newest version completely written in every reader's ring (one ring per trainer rank or host,
    each holding its rows), copied from all of them concurrently: (version, each reader's weights, as
    views of its own copy, valid until its next pull), or None if there is none newer than `newer_than`.

    A copy that any ring's seqlock refuses (overtaken: the trainer started on its slot meanwhile) is
    thrown away and the newest complete version, by then in another slot, is copied instead; more than
    `max_attempts` of those in a row is TornReadsError (the ring is too small for how fast the trainer
    publishes). A copy a checksum refuses (stores seen out of order, or a corrupt ring) is copied again
    after a short wait, and one still refused `max_attempts` times is CorruptWeightsError. So the result
    is never torn nor a mix of versions. Cancelling the pull (a timeout) stops its copies at their next
    chunk; they only ever write the readers' own memory."""
    cancel = threading.Event()
    torn = corrupt = 0
    try:
        while True:
            before = await asyncio.gather(*(r.read_header() for r in readers))
            newest = _newest_common(readers, before, newer_than)
            if newest is None:
                return None
            version, slots = newest
            begins = [[row[BEGIN] for row in b[slot]] for b, slot in zip(before, slots)]
            whole = await asyncio.gather(*(r.read_payload(slot, b, cancel)
                                           for r, slot, b in zip(readers, slots, begins)))
            after = await asyncio.gather(*(r.read_header() for r in readers))
            if _torn(readers, before, after, slots) or not all(whole):
                torn += 1
                if torn >= max_attempts:
                    raise TornReadsError(f"no untorn read in {max_attempts} attempts: the trainer overwrites "
                                         "slots faster than this reader copies them; use more weight_sync.slots")
                continue
            sums = await asyncio.gather(*(asyncio.to_thread(r.check_sum, b[slot])
                                          for r, b, slot in zip(readers, before, slots) if r.handle.checksums))
            if all(sums):
                return version, [r.layout.unpack(r.bytes) for r in readers]
            corrupt += 1
            if corrupt >= max_attempts:
                raise CorruptWeightsError(f"weights of version {version} keep failing their checksum")
            await asyncio.sleep(min(0.001 * corrupt, 0.05))  # stores still landing: look again shortly
    finally:
        cancel.set()  # an abandoned copy stops at its next chunk
