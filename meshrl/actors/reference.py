"""The reference model: the frozen initial policy, whose logprobs the KL penalty pulls toward.

It is placed as the trainer is (meshrl/actors/distributed.py): `reference.device`, and with
`reference.ranks` > 1 sharded over that many processes by torchtitan's FSDP2, every rank answering for
its own share of the step's micro-batches, all of them in one call. Frozen, it holds its weights in
`reference.dtype`: bf16 (half the memory of fp32) where its forward runs in bf16 autocast anyway
(meshrl/models/memory.py).
"""

from monarch.actor import Actor, endpoint

from meshrl.actors.distributed import each_micro_batch, join, load_on_ranks, memory_of, to_buffer
from meshrl.actors.reference_config import ReferenceConfig
from meshrl.losses import policy_logprobs
from meshrl.types import BatchRef


class ReferenceModel(Actor):
    def __init__(self, config: ReferenceConfig, checkpoint: str):
        me = join(config.device, config.cpus, config.num_threads)
        self.config, self.device = config, me.device
        # its weights in `reference.dtype` (auto: bf16 where its forward runs in bf16 autocast)
        self.model, _ = load_on_ranks(checkpoint, me, memory=memory_of(config, self.device), frozen=True)
        self.model.eval().requires_grad_(False)
        self.buffer = None  # the replay buffer BatchRefs name micro-batches of

    @endpoint
    async def attach_buffer(self, buffer) -> None:
        """Take micro-batches from this replay buffer (meshrl/actors/replay_buffer.py) from now on."""
        self.buffer = buffer

    @endpoint
    async def ping(self) -> None:
        """Answer, changing nothing: whether this actor is still there (a restart's probe, meshrl/restarts.py)."""

    @endpoint
    async def logprobs(self, refs: list[BatchRef]) -> None:
        """log p_ref of every target token [B, T] of each micro-batch `refs` names, in order, put back into the
        replay buffer as its field `ref.into`."""
        async def compute(ref: BatchRef, micro) -> None:
            values = policy_logprobs(self.model, micro.to(self.device), self.config.bf16_autocast).cpu()
            await to_buffer(self.buffer, ref, values)
        await each_micro_batch(self.buffer, refs, compute)
