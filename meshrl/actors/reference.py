"""The reference model: the frozen initial policy, whose logprobs the KL penalty pulls toward.

It is placed as the trainer is (meshrl/actors/distributed.py): `reference.device`, and with
`reference.ranks` > 1 sharded over that many processes by torchtitan's FSDP2, every rank answering
for its own micro-batch of each round.
"""

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors.distributed import join, load_on_ranks
from meshrl.configs import ReferenceConfig
from meshrl.losses import policy_logprobs
from meshrl.types import TrainBatch


class ReferenceModel(Actor):
    def __init__(self, config: ReferenceConfig, checkpoint: str):
        me = join(config.device, config.cpus, config.num_threads)
        self.config, self.device = config, me.device
        self.model, _ = load_on_ranks(checkpoint, me)
        self.model.eval().requires_grad_(False)

    @endpoint
    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log p_ref of every target token [B, T] (on the host, for the caller)."""
        return policy_logprobs(self.model, batch.to(self.device), self.config.bf16_autocast).cpu()
