"""Stand-ins that let `meshrl check gpu` run the trainer actor's code on a machine that lacks part of the
stack (a lent GPU machine has torch and CUDA but no Monarch or vLLM), and the in-process call of an
endpoint, real or stood in.

- `monarch.actor` and `monarch.rdma`: the trainer actor class is built as a plain object and its endpoints
  are called in this process (`call`); a ring's RDMA handles become plain references to its memory (a
  reader on the same host copies over shared memory anyway). The generators' modules also import Monarch's
  `SupervisionError`: a plain exception class here.
- `torch.distributed.fsdp.DataParallelMeshDims`: torchtitan 0.3 imports it; torch 2.11 lacks it (2.13 has it),
  and FSDP over one mesh dimension never passes it (torchtitan only hands it on when it is set).

Each is installed only where the real one is missing (Monarch also where it fails to import, or on
request), and `install` says which were and why, so the check's output names the parts that ran on
stand-ins.
"""

import asyncio
import functools
import importlib.util
import sys
import types


def _standin_monarch() -> dict[str, types.ModuleType]:
    actor = types.ModuleType("monarch.actor")

    class Actor:  # the real base class registers with a mesh; a stand-in actor is a plain object
        pass

    class ActorError(Exception):
        pass

    def endpoint(method=None, **options):
        def mark(m):
            m.explicit_response_port = options.get("explicit_response_port", False)
            return m
        return mark(method) if method is not None else mark

    def concurrent_endpoint(method=None, **_options):
        def mark(m):
            m.concurrent = True
            return m
        return mark(method) if method is not None else mark

    def this_host():
        raise RuntimeError("monarch.actor is a stand-in here (meshrl check gpu): no process can be spawned")

    actor.Actor, actor.ActorError, actor.endpoint, actor.concurrent_endpoint = Actor, ActorError, endpoint, \
        concurrent_endpoint
    actor.this_host, actor.current_rank = this_host, lambda: {"procs": 0}
    rdma = types.ModuleType("monarch.rdma")

    class RDMABuffer:
        """A reference to the bytes it was made over, read by copying (no network)."""

        def __init__(self, tensor):
            self.tensor = tensor

        def size(self) -> int:
            return self.tensor.numel()

        async def read_into(self, dst):
            dst.copy_(self.tensor)

        async def write_from(self, src):
            self.tensor.copy_(src)

    rdma.RDMABuffer = RDMABuffer
    # the generators' modules import the error a dead actor's call raises (no actor dies in this process)
    names = ("monarch._rust_bindings", "monarch._rust_bindings.monarch_hyperactor",
             "monarch._rust_bindings.monarch_hyperactor.supervision")
    bindings = {name: types.ModuleType(name) for name in names}
    bindings[names[-1]].SupervisionError = type("SupervisionError", (Exception,), {})
    monarch = types.ModuleType("monarch")
    monarch.__path__ = []  # a package: `import monarch.actor` finds the entries below
    for module in (monarch, actor, rdma, *bindings.values()):
        module.STAND_IN = True
    for parent, child in zip(names[:-1], names[1:]):
        bindings[parent].__path__ = []
        setattr(bindings[parent], child.rsplit(".", 1)[1], bindings[child])
    monarch.actor, monarch.rdma, monarch._rust_bindings = actor, rdma, bindings[names[0]]
    return {"monarch": monarch, "monarch.actor": actor, "monarch.rdma": rdma, **bindings}


def install(force_monarch: bool = False) -> list[str]:
    """Install the stand-ins for what this machine lacks (Monarch also when `force_monarch`, or where it is
    installed but does not import); returns what was stood in, and why. Call it before anything imports
    meshrl.actors or torchtitan."""
    stood_in = []
    why = "asked for (--stand-ins)" if force_monarch else monarch_fails()
    if why:
        if not getattr(sys.modules.get("monarch"), "STAND_IN", False):
            if held := holding_monarch():
                raise RuntimeError(f"{', '.join(held)} imported the real Monarch before its stand-in")
            for name in [n for n in sys.modules if n == "monarch" or n.startswith("monarch.")]:
                del sys.modules[name]  # what a failed import left
            sys.modules.update(_standin_monarch())
        stood_in.append(f"monarch (monarch.actor, monarch.rdma, its SupervisionError): actors built and called in "
                        f"this process; {why}")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        stood_in.append(f"torch.distributed.fsdp.DataParallelMeshDims (torch {torch_version()} lacks it; "
                        "torchtitan 0.3 imports it)")
    return stood_in


def holding_monarch() -> list[str]:
    """The loaded meshrl modules holding an object of the real Monarch (imported before its stand-in could be).
    meshrl.actors itself and the run's config load no Monarch (tests/test_layout.py), the actor modules do."""
    return sorted(name for name, module in list(sys.modules.items()) if name.startswith("meshrl.") and module
                  and any(str(getattr(value, "__module__", "")).startswith("monarch") for value in vars(module).values()))


def torch_version() -> str:
    import torch

    return torch.__version__


def monarch_fails() -> str | None:
    """None where Monarch's actor and RDMA modules import here, else why not (not installed; or installed and
    failing, as a build for another torch may)."""
    if available("monarch") and not getattr(sys.modules.get("monarch"), "STAND_IN", False):
        try:
            import monarch.actor  # noqa: F401
            import monarch.rdma  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any failure to import is the reason for the stand-in, reported
            return f"installed but its import failed: {type(e).__name__}: {e}"
        return None
    return "not installed"


def available(module: str) -> bool:
    """Whether `module` is installed for real (not a stand-in)."""
    if module in sys.modules:
        return not getattr(sys.modules[module], "STAND_IN", False)
    return importlib.util.find_spec(module) is not None


def call(actor, name: str, *args, **kwargs):
    """The coroutine of `actor`'s endpoint `name` called in this process: a real Monarch endpoint's own
    method (a concurrent endpoint's, unwrapped from the task Monarch would start), or the stand-in's; one
    that answers on an explicit response port (the trainer's publish_weights) is given a port here, and the
    coroutine returns what it sends."""
    prop = getattr(type(actor), name)
    method = getattr(prop, "_method", None)
    if method is None:  # the stand-in: a plain method
        explicit = getattr(prop, "explicit_response_port", False)
        method = getattr(actor, name)
    else:
        explicit = prop._explicit_response_port
        if getattr(method, "_monarch_concurrent_endpoint_wrapper", False):
            method = method.__wrapped__
        method = functools.partial(method, actor)
    return _answered(method, *args, **kwargs) if explicit else method(*args, **kwargs)


async def _answered(method, *args, **kwargs):
    """What an endpoint with an explicit response port sends on it (raised, if it sends an error)."""
    port = _Port()
    await method(port, *args, **kwargs)
    return await port.answer


class _Port:
    """A response port in this process: the answer (or the error) sent on it, as a future."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()

    def send(self, value) -> None:
        self.answer.set_result(value)

    def exception(self, error: BaseException) -> None:
        self.answer.set_exception(error)
