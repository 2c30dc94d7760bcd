"""The reference model: the frozen initial policy, whose logprobs the KL penalty pulls toward."""

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import pin_cpus
from meshrl.configs import ReferenceConfig
from meshrl.losses import policy_logprobs
from meshrl.model import load_policy
from meshrl.types import TrainBatch


class ReferenceModel(Actor):
    def __init__(self, config: ReferenceConfig, checkpoint: str):
        pin_cpus(config.cpus, config.num_threads)
        self.config = config
        self.model, _ = load_policy(checkpoint)
        self.model.eval().requires_grad_(False)

    @endpoint
    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log p_ref of every target token [B, T]."""
        return policy_logprobs(self.model, batch, self.config.bf16_autocast)
