"""The weight ring in device memory: a version goes from the trainer's GPUs to the generators' without
crossing host memory (`weight_sync.memory device`).

The host ring (ring.py) costs a version about six host copies on a GPU node: device-to-host staging, a
memcpy into the ring, each reader's copy, host-to-device inside vLLM. Here the slots themselves are GPU
memory. The protocol is the host ring's: the same versions, slot `version % slots`, one header row
(begin, end, version, checksum) per slot and writer, the same seqlock and the same fences; only the
payload moved.

    trainer host, ranks r0..r(n-1) (each on its GPU)            a generator on the same host
    header (host memfd, a few rows) <- each writer's rows        -> read before and after a load
    segment 0 (GPU of r0): slots x [tensors A..F]  <- every rank writes its rows of A..F
    segment 1 (GPU of r1): slots x [tensors G..M]  <- every rank writes its rows of G..M    CUDA IPC
    ...                                                          -> vLLM copies device to device

The ring holds whole tensors, in the layout of the ranks' rows put together (shards.py), cut at tensor
boundaries into one segment per writer, each segment on its writer's GPU: a GPU holds about 1/n of the
slots' bytes, and every tensor lies whole in one segment, so a reader hands vLLM plain views and
nothing is assembled. Each rank writes its rows of every tensor into whichever segment holds it
(device to device: NVLink or PCIe peer copies), on a side stream ordered after the optimizer step
(`DeviceMark`), and writes `end` once its copies are done.

A reader loads in place, then checks: it picks the newest slot every writer completed, hands views of
it to vLLM's weight loaders (which copy each tensor-parallel worker's slice into the engine's weights,
the engine taking no step meanwhile), and reads the header again. If a writer began on that slot during
the load, the load is torn: counted, and the newest complete version is loaded instead before the
engine steps again. With checksums, each writer's pieces are summed on the device after they are
written, and a reader sums the slot once it loaded it. So no extra copy of the model is held anywhere:
the reader's "own copy" of the host ring is the engine's weights themselves.

Device memory and its handles have two kinds (`DeviceMemory`): CUDA memory shared by CUDA IPC (the
opener finds the GPU by its UUID, whatever its CUDA_VISIBLE_DEVICES numbers it), and on the CPU host
memory shared as a memfd, which stands in for the GPU's in the CPU's tests and `meshrl check gpu --dry`:
the same ring, the same protocol, the same readers. Readers on another host read the host ring
(`route`): RDMA from GPU memory is not done yet (docs/gpu.md).
"""

import logging
import secrets
import socket
from dataclasses import dataclass
from typing import Callable

import torch

from meshrl.weight_sync import MEMORIES, WeightLayout
from meshrl.weight_sync.ordering import fence, needs_checksums
from meshrl.weight_sync.ring import (BEGIN, CHECKSUM, END, VERSION, CorruptWeightsError, Pieces, RingHandle,
                                     SharedMemory, TornReadsError, checksum_of, complete_versions, host_id)

logger = logging.getLogger(__name__)
Region = tuple  # what another process of the host opens a DeviceMemory with (`region()`, `open_region`)


def ring_memory(memory: str, trainer_on_gpus: bool, trainer_hosts: int, generators_beside: bool, relay: str,
                lora: bool = False) -> str:
    """`weight_sync.memory` for a placement. auto: device where every generator opens the ring by CUDA IPC (the
    trainer's ranks on one host's GPUs, the generators beside them, no relay) and the trainer publishes the whole
    model (a LoRA adapter is a few MB: merging it on the trainer's GPU would cost more than the host ring's
    copies); host otherwise, since whether a NIC reads GPU memory is not known before the run (generators on
    other hosts read a device ring by Monarch RDMA: `device` asks for it)."""
    if memory not in MEMORIES:
        raise ValueError(f"unknown weight_sync.memory {memory!r}; known: {', '.join(MEMORIES)}")
    if memory == "auto":
        by_ipc = trainer_hosts == 1 and generators_beside and relay != "on"
        return "device" if by_ipc and trainer_on_gpus and not lora else "host"
    return memory


def remote_handles(handles: list) -> list:
    """The trainer's ring handles as readers on other hosts (and relays) read them: a device ring's by Monarch
    RDMA (its `remote`), a host ring's as it is. RuntimeError (one line) where a device ring cannot be read so."""
    out = []
    for h in handles:
        if isinstance(h, DeviceRingHandle):
            if h.remote is None:
                raise RuntimeError(f"the weight ring in GPU memory of {h.hostname} cannot be read over RDMA from "
                                   "another host (Monarch refused to register it): use weight_sync.memory host")
            h = h.remote
        out.append(h)
    return out


class DeviceMemory:
    """Flat uint8 memory on a device that other processes of the host can open: CUDA memory (CUDA IPC), or on
    the CPU a memfd standing in for it."""

    def __init__(self, tensor: torch.Tensor, shared: SharedMemory | None = None):
        self.tensor, self.shared = tensor, shared

    @staticmethod
    def allocate(nbytes: int, device: torch.device) -> "DeviceMemory":
        if torch.device(device).type == "cuda":
            return DeviceMemory(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device))
        shared = SharedMemory.create(max(nbytes, 1))
        return DeviceMemory(shared.tensor, shared)

    def region(self) -> Region:
        """What another process of this host needs to open this memory: a memfd's (pid, fd, nbytes), as the
        host ring's regions are (meshrl/weight_sync/handoff.py maps those), or ("cuda_ipc", GPU UUID, the
        arguments of torch's CUDA IPC rebuild)."""
        if self.shared is not None:
            return self.shared.region()
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        uuid = str(torch.cuda.get_device_properties(self.tensor.device).uuid)
        return ("cuda_ipc", uuid, args)


def open_region(region: Region) -> torch.Tensor:
    """Another process's DeviceMemory (same host) as flat bytes here: mapped (memfd) or opened (CUDA IPC)."""
    if region[0] != "cuda_ipc":
        return SharedMemory.attach(*region).tensor
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    _, uuid, args = region
    here = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    if not here:
        raise RuntimeError(f"the weight ring's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES): "
                           "use weight_sync.memory host")
    args = list(args)
    args[6] = here[0]  # storage_device: that GPU's number in this process
    return rebuild_cuda_tensor(*args)


def segments(layout: WeightLayout, n: int) -> list[tuple[int, int]]:
    """`layout`'s bytes cut at tensor boundaries into `n` [start, end) ranges, each cut at the tensor start
    nearest to an n-th of the bytes (some may be empty: fewer tensors than writers)."""
    starts = [spec.offset for spec in layout.specs] + [layout.nbytes]
    bounds = [0]
    for k in range(1, n):
        cut = min(starts, key=lambda s: abs(s - k * layout.nbytes / n))
        bounds.append(max(cut, bounds[-1]))
    bounds.append(layout.nbytes)
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class DeviceRingHandle:
    """What a reader on the ring's host needs: picklable, passed between actors."""

    layout: WeightLayout  # the whole tensors of ranks [ranks[0], ranks[1]), back to back
    slots: int
    host: str  # the trainer's host_id()
    hostname: str
    header: tuple[int, int, int]  # the header's memfd: (pid, fd, nbytes)
    token: int
    bounds: list[tuple[int, int]]  # each segment's byte range of the layout
    regions: list[Region]  # each segment's memory: `slots` copies of its range, one after another
    checksums: bool
    pieces: Pieces  # each writer's (tensor, first byte, end byte) of the layout
    ranks: tuple[int, int] = (0, 1)
    world: int = 1
    device: str = "cpu"  # where the segments live: "cuda" or the CPU's stand-in
    remote: RingHandle | None = None  # the same ring for readers on other hosts: Monarch RDMA (None: not here)

    @property
    def writers(self) -> int:
        return len(self.pieces)


def _header_size(slots: int, writers: int) -> int:
    return 8 * (1 + 4 * slots * writers)


class DeviceRing:
    """Trainer side: writer `writer` of the ring its host's ranks share; `publish` writes its pieces of a version
    into the slot's segments, then its row's `end`."""

    def __init__(self, layout: WeightLayout, slots: int, checksums: bool, pieces: Pieces | None,
                 ranks: tuple[int, int], world: int, writer: int, device: torch.device,
                 gather: Callable[[object], list], chunk_mb: int = 16, register: bool = True):
        """Collective over the host's writers: `gather(x)` returns each writer's x in writer order. Writer 0
        creates the header; each writer allocates its own segment and opens the others'. With `register`, each
        also registers its segment with Monarch RDMA in chunks of `chunk_mb`, for readers on other hosts."""
        if slots < 2:
            raise ValueError("a weight ring needs at least 2 slots, so readers never race the only copy")
        self.layout, self.slots, self.writer = layout, slots, writer
        self.checksums = checksums or needs_checksums()
        self.pieces = pieces or [[(s.name, s.offset, s.offset + s.nbytes) for s in layout.specs]]
        writers = len(self.pieces)
        self.bounds = segments(layout, writers)
        lo, hi = self.bounds[writer]
        self.mine = DeviceMemory.allocate(slots * (hi - lo), device)
        header = SharedMemory.create(_header_size(slots, writers)) if writer == 0 else None
        if header is not None:
            header.tensor[:8].view(torch.int64).fill_(secrets.randbits(62))
        self.checksum_kind = "words" if torch.device(device).type == "cuda" else "crc32"  # `checksum_of`
        chunks = _register(self.mine.tensor, slots, hi - lo, chunk_mb << 20) if register else None
        shared = gather((self.mine.region(), header.region() if header else None, chunks))
        self.header_region = shared[0][1]
        self.header_memory = header or SharedMemory.attach(*self.header_region)
        self.token = int(self.header_memory.tensor[:8].view(torch.int64))
        self.rows = self.header_memory.tensor[8:].view(torch.int64).view(slots, writers, 4)
        self.regions = [region for region, _, _ in shared]
        self.chunks = None if any(c is None for _, _, c in shared) else [  # per slot, every segment's in order
            [chunk for _, _, c in shared for chunk in c[slot]] for slot in range(slots)]
        memories = [self.mine.tensor if k == writer else open_region(r) for k, r in enumerate(self.regions)]
        self.slot_views = [[m[s * (b - a):(s + 1) * (b - a)] for m, (a, b) in zip(memories, self.bounds)]
                           for s in range(slots)]
        self.dtypes = {spec.name: spec.dtype for spec in layout.specs}
        self.ranks, self.world, self.device = ranks, world, torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.publishes = 0

    def handle(self) -> DeviceRingHandle | None:
        """The ring's handle, from its first writer (the others' None, as with the host ring)."""
        if self.writer:
            return None
        remote = None
        if self.chunks is not None:
            from monarch.rdma import RDMABuffer

            # pid -1: never mapped as a host ring's memory, so every reader of it reads over RDMA
            remote = RingHandle(self.layout, self.slots, host_id(), socket.gethostname(), -1, -1, self.token,
                                RDMABuffer(self.header_memory.tensor), self.chunks, self.checksums, self.pieces,
                                self.ranks, self.world, self.checksum_kind)
        return DeviceRingHandle(self.layout, self.slots, host_id(), socket.gethostname(), self.header_region,
                                self.token, self.bounds, self.regions, self.checksums, self.pieces, self.ranks,
                                self.world, self.device.type, remote)

    def where(self, lo: int, hi: int, slot: int) -> torch.Tensor:
        return span(self.bounds, self.slot_views[slot], lo, hi)

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Write this writer's rows of `version` (its shard's tensors, on its device) into the slot, seqlock style,
        from one thread; on CUDA the copies go on the ring's side stream (ordered after the step that made them
        by `DeviceMark`) and are waited for before `end` is stored."""
        slot = version % self.slots
        self.publishes += 1
        row = self.rows[slot, self.writer]
        row[BEGIN] = self.publishes
        fence()  # begin is visible before any byte of the new payload
        targets = [(self.where(lo, hi, slot).view(self.dtypes[name]), weights[name].reshape(-1))
                   for name, lo, hi in self.pieces[self.writer]]
        with torch.no_grad():
            if self.device.type == "cuda":
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    for target, source in targets:
                        target.copy_(source, non_blocking=True)
                    total = self._sum(slot) if self.checksums else 0
                    torch.cuda.current_stream().synchronize()
            else:
                for target, source in targets:
                    target.copy_(source)
                total = self._sum(slot) if self.checksums else 0
        row[VERSION] = version
        row[CHECKSUM] = total
        fence()  # the payload, version and checksum are visible before end says the slot is complete
        row[END] = self.publishes

    def _sum(self, slot: int) -> int:
        return checksum_of([self.where(lo, hi, slot) for _, lo, hi in self.pieces[self.writer]], self.checksum_kind)


def _register(memory: torch.Tensor, slots: int, nbytes: int, chunk: int) -> list[list] | None:
    """Monarch RDMA buffers over each slot of a segment (`slots` copies of `nbytes`), in chunks; None where this
    memory cannot be registered (a GPU without RDMA from its memory here): readers on other hosts then have
    no way in, and say so."""
    try:
        from monarch.rdma import RDMABuffer

        return [[RDMABuffer(memory[s * nbytes + i:s * nbytes + min(i + chunk, nbytes)])
                 for i in range(0, nbytes, chunk)] for s in range(slots)]
    except Exception as e:  # Monarch refuses this memory: the ring still serves its own host
        logger.warning("the weight ring's segment on %s cannot be read over RDMA: %s", memory.device, e)
        return None


def span(bounds: list[tuple[int, int]], views: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """The bytes [lo, hi) of the layout: a view of the segment (of `views`, one per range of `bounds`) that holds
    them (segments are cut between tensors, so a tensor's bytes lie in one)."""
    for (a, b), view in zip(bounds, views):
        if a <= lo and hi <= b and (lo < b or lo == hi):
            return view[lo - a:hi - a]
    raise ValueError(f"bytes {lo}-{hi} cross a segment boundary")


class DeviceMark:
    """How a rank's shard reaches a device ring: on CUDA, an event on the current stream marks the weights the
    optimizer step made (`start`, on the thread that ran it), and the ring's side stream waits for it (`finish`,
    in the copy thread), so the next forward and backward queued on the default stream run meanwhile; the
    next update waits for the publish (the trainer's `_published`). On the CPU the weights as they are."""

    def __init__(self, ring: DeviceRing):
        self.ring = ring

    def start(self, weights: dict[str, torch.Tensor]):
        if self.ring.stream is None:
            return weights, None
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.ring.device))
        return weights, made

    def finish(self, started) -> dict[str, torch.Tensor]:
        weights, made = started
        if made is not None:
            self.ring.stream.wait_event(made)
            for source in weights.values():
                source.record_stream(self.ring.stream)  # not reused by the allocator before the copy ends
        return weights


def device_ring_for(full: WeightLayout, rank: int, world: int, gather: Callable[[object], list], slots: int,
                    checksums: bool, device: torch.device, chunk_mb: int = 16) -> DeviceRing:
    """This rank's device ring: one per run of consecutive ranks on one host (as `host_ring`), each rank a
    writer of its rows and the holder of one segment. Collective over all ranks (`gather`: an all-gather)."""
    from meshrl.weight_sync.shards import same_host_run, shard_layout, writer_pieces

    first, end = same_host_run(gather(host_id()), rank)
    pieces = writer_pieces(full, first, end, world)
    return DeviceRing(shard_layout(full, first, world, end), slots, checksums, pieces, (first, end), world,
                      rank - first, device, lambda x: gather(x)[first:end], chunk_mb)


class DeviceRingReader:
    """Generator side, on the ring's host: the newest version every writer completed, loaded in place by the
    caller's `load` and checked after it (see the module's docstring)."""

    def __init__(self, handle: DeviceRingHandle, expected: WeightLayout, to_hf: Callable[[dict], dict],
                 max_attempts: int = 50):
        if handle.host != host_id():
            raise RuntimeError(f"the weight ring in device memory of {handle.hostname} is not on this host: read it "
                               "over RDMA (`remote_handles`)")
        handle.layout.check_matches(expected)
        self.handle, self.layout, self.to_hf, self.max_attempts = handle, expected, to_hf, max_attempts
        self.transport = "cuda_ipc" if handle.device == "cuda" else "device_standin"  # placement.json says which
        self.header = SharedMemory.attach(*handle.header)
        if int(self.header.tensor[:8].view(torch.int64)) != handle.token:
            raise RuntimeError(f"the weight ring of {handle.hostname} is not this host's")
        self.rows = self.header.tensor[8:].view(torch.int64).view(handle.slots, handle.writers, 4)
        self.memories = [open_region(r) for r in handle.regions]
        self.torn_reads = self.corrupt_reads = 0
        self.bytes_read = self.reported_bytes = 0

    def header_now(self) -> list[list[list[int]]]:
        rows = self.rows.tolist()
        fence()
        return rows

    def views(self, slot: int) -> list[torch.Tensor]:
        """Each segment of `slot`, as flat bytes."""
        return [m[slot * (b - a):(slot + 1) * (b - a)] for m, (a, b) in zip(self.memories, self.handle.bounds)]

    def weights(self, slot: int) -> list[tuple[str, torch.Tensor]]:
        """The slot's tensors under HF names, views of the ring (valid while the slot holds its version)."""
        segs = self.views(slot)
        out = {spec.name: span(self.handle.bounds, segs, spec.offset, spec.offset + spec.nbytes)
                .view(spec.dtype).view(spec.shape) for spec in self.layout.specs}
        return list(self.to_hf(out).items())

    def memory(self) -> list["Opened"]:
        """The memory the weights lie in, for a tensor-parallel replica's workers (meshrl/weight_sync/handoff.py)."""
        return [Opened(m, region) for region, m in zip(self.handle.regions, self.memories)]

    async def newest(self) -> int:
        complete = complete_versions(self.header_now())
        return max(complete, default=-1)

    def take_trainer_bytes(self) -> int:
        taken, self.reported_bytes = self.bytes_read - self.reported_bytes, self.bytes_read
        return taken

    async def load_latest(self, load, newer_than: int = -1) -> int | None:
        """`await load(version, weights)` with the newest version newer than `newer_than`, as views of the ring,
        then the header read again: a load a writer overtook is done again with the newest complete version
        (TornReadsError after `max_attempts`), so it returns only once the engine holds one whole version; None
        if there is none newer."""
        held = False  # the engine holds a load that failed its check
        corrupt = 0
        for _ in range(self.max_attempts):
            header = self.header_now()
            complete = complete_versions(header)
            version = max(complete, default=-1)
            if version <= newer_than and not held:
                return None
            if version <= newer_than:  # the engine holds part of a torn load and nothing whole replaces it
                raise TornReadsError("a load was torn and no newer whole version is in the ring")
            slot = complete[version]
            begins = [row[BEGIN] for row in header[slot]]
            await load(version, self.weights(slot))
            if self.handle.device == "cuda":  # the loads' copies are done before the header is looked at again
                for device in {torch.cuda.current_device(), *(m.device for m in self.memories)}:
                    torch.cuda.synchronize(device)
            fence()
            sums = self._sums(slot) if self.handle.checksums else None
            now = self.header_now()
            self.bytes_read += self.layout.nbytes
            held = True
            if [row[BEGIN] for row in now[slot]] != begins:
                self.torn_reads += 1
                continue
            if sums is not None and sums != [row[CHECKSUM] for row in header[slot]]:
                self.corrupt_reads += 1
                corrupt += 1
                continue
            return version
        if corrupt:
            raise CorruptWeightsError(f"versions in the device ring failed their checksum {corrupt} times in "
                                      f"{self.max_attempts} loads")
        raise TornReadsError(f"no untorn load in {self.max_attempts} attempts: the trainer overwrites slots faster "
                             "than this replica loads them; use more weight_sync.slots")

    def _sums(self, slot: int) -> list[int]:
        """Each writer's checksum of what `slot` holds now."""
        segs = self.views(slot)
        kind = "words" if self.handle.device == "cuda" else "crc32"
        return [checksum_of([span(self.handle.bounds, segs, lo, hi) for _, lo, hi in mine], kind)
                for mine in self.handle.pieces]


@dataclass
class Opened:
    """Another process's device memory opened here: its bytes and how to open it again (a handoff's region)."""

    tensor: torch.Tensor
    _region: Region

    def region(self) -> Region:
        return self._region
