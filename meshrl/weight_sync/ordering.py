"""Memory ordering for the weight ring's seqlock, made explicit on every CPU.

The ring is a seqlock (meshrl/weight_sync/ring.py): a writer stores a slot's `begin`, then its payload,
then its `end`; a reader loads the header, then the payload, then the header again. That is correct
only if the writer's stores become visible to other cores in that order and the reader's loads are
performed in that order. x86-64 guarantees both in hardware (TSO: stores are not reordered with
stores, loads not with loads). ARM (aarch64: GH200 and GB200 hosts) and POWER do not: without
barriers a reader there can see a slot's `end` before the payload written ahead of it.

Python has no fence of its own, and the ring's rows and payload are written and read by torch ops
called from Python. So `fence()` calls libatomic's `atomic_thread_fence(memory_order_seq_cst)` through
ctypes: a real full barrier (`lock or` on x86-64, `dmb ish` on aarch64), issued by the thread that did
the stores or loads it separates. A ctypes call is also opaque to the compiler, as every torch op is.

Where libatomic cannot be loaded, `fence()` does nothing. x86 then still orders the ring by TSO alone
(every store and load is in a separate torch op, a call no compiler reorders across; the GIL's release
points add nothing across processes). Any other CPU without the fence cannot rely on the seqlock: a
ring there checksums every version whatever `weight_sync.checksums` says (`needs_checksums()`), and
readers verify the copy they are about to load, so a write seen out of order is a checksum mismatch,
retried, and never loaded.
"""

import ctypes
import ctypes.util
import platform

TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
_SEQ_CST = 5  # memory_order_seq_cst in C11's <stdatomic.h>


def _libatomic_names():
    yield "libatomic.so.1"
    yield ctypes.util.find_library("atomic")  # runs ldconfig (a process): only where the usual name did not load


def _load_fence():
    """libatomic's atomic_thread_fence, or None where it cannot be loaded."""
    for name in _libatomic_names():
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None


_FENCE = _load_fence()


def has_fence() -> bool:
    return _FENCE is not None


def fence() -> None:
    """A full memory barrier: this thread's loads and stores before it are ordered before those after it,
    for every other core and process (a no-op where libatomic is missing: see the module's docstring)."""
    if _FENCE is not None:
        _FENCE(_SEQ_CST)


def is_tso(machine: str | None = None) -> bool:
    """Whether the CPU orders stores with stores and loads with loads by itself (x86)."""
    return (machine or platform.machine()).lower() in TSO_MACHINES


def ordering() -> str:
    """How the ring's seqlock is ordered here: "fences" (libatomic), "tso" (x86 without libatomic), or
    "checksums" (neither: every version is checksummed and verified before it is loaded)."""
    return "fences" if has_fence() else "tso" if is_tso() else "checksums"


def needs_checksums() -> bool:
    """Whether the seqlock alone cannot be trusted here, so that rings must checksum every version."""
    return ordering() == "checksums"
