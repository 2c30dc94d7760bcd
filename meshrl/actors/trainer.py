"""The trainer: the policy as torchtitan's Llama3 model, trained with the loss its config names.

It trains only: advantages arrive in the batch, computed by the controller. A step may take several
optimizer updates (`optim_step`); `policy_version` counts published versions, one per step.
"""

from pathlib import Path

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import pin_cpus
from meshrl.configs import TrainerConfig, WeightSyncConfig
from meshrl.losses import (check, on_positions, policy_logprobs, policy_loss, response_logits, token_entropy,
                           token_logprobs)
from meshrl.model import load_hf_weights, load_policy, save_checkpoint
from meshrl.types import TrainBatch
from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import RingHandle, WeightRing


class TitanTrainer(Actor):
    def __init__(self, config: TrainerConfig, weight_sync: WeightSyncConfig, checkpoint: str):
        pin_cpus(config.cpus, config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.checkpoint = Path(checkpoint)
        check(config.loss)
        hf_weights = load_hf_weights(self.checkpoint)
        self.model, self.adapter = load_policy(self.checkpoint, hf_weights)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        # Publish in the checkpoint's own layout (HF names and dtype): what the generator loads.
        self.ring = WeightRing(WeightLayout.of_tensors(hf_weights), weight_sync.slots, weight_sync.chunk_mb,
                               weight_sync.checksums)
        self.policy_version = 0  # versions published
        self.updates = 0  # optimizer updates taken

    @endpoint
    async def forward_backward(self, batch: TrainBatch) -> dict:
        """Accumulate the loss's gradient over one micro-batch; returns the loss's metric sums."""
        mask = batch.loss_mask
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16_autocast):
            logits = response_logits(self.model, batch)
        with torch.set_grad_enabled(self.config.loss.entropy_coef > 0):  # else the entropy is a metric only
            entropy = on_positions(token_entropy(logits), mask)
        logprobs = on_positions(token_logprobs(logits, batch.target_ids[mask]), mask)
        loss, metrics = policy_loss(logprobs, batch, self.config.loss, entropy)
        loss.backward()
        return metrics

    @endpoint
    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's logprob of every target token [B, T], without training."""
        return policy_logprobs(self.model, batch, self.config.bf16_autocast)

    @endpoint
    async def optim_step(self) -> dict:
        """One optimizer update from the accumulated gradients (it publishes nothing)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"updates": self.updates, "grad_norm": float(grad_norm)}

    @endpoint
    async def weight_ring(self) -> RingHandle:
        """Where generators pull published weights from."""
        return self.ring.handle()

    @endpoint
    async def publish_weights(self) -> int:
        """Put the current policy into the weight ring as the next version (no waiting for readers);
        return that version."""
        self.policy_version += 1
        self.ring.publish(self._hf_weights(), self.policy_version)
        return self.policy_version

    @endpoint
    async def save(self, path: str) -> None:
        """Write the current policy as an HF checkpoint (loadable by vLLM and transformers)."""
        save_checkpoint(self._hf_weights(), self.checkpoint, Path(path))

    @torch.no_grad()
    def _hf_weights(self) -> dict[str, torch.Tensor]:
        return self.adapter.to_hf(self.model.state_dict())
