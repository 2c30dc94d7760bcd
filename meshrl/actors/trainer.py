"""The trainer: the policy as torchtitan's Llama3 model, trained with a clipped policy-gradient loss.

It trains only: advantages arrive in the batch, computed by the controller.
"""

from pathlib import Path

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import pin_cpus
from meshrl.configs import TrainerConfig, WeightSyncConfig
from meshrl.model import build_policy, load_hf_weights, read_hf_config, save_checkpoint
from meshrl.types import TrainBatch
from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import RingHandle, WeightRing


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position, in float32."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def ppo_clip_loss(logprobs: torch.Tensor, batch: TrainBatch, clip_eps: float,
                  tis_cap: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-token PPO-clip on the importance ratio against the generator's behaviour logprobs.

    The ratio corrects for off-policy (stale) episodes; with `tis_cap` > 0 it is truncated there
    (truncated importance sampling), which bounds the pull of tokens the trainer now finds far more
    likely than the generator did. The loss is summed and divided by the step's loss tokens, so
    micro-batches add up to one token mean. Metrics are sums over loss tokens.
    """
    mask = batch.loss_mask
    log_ratio = torch.where(mask, logprobs - batch.behaviour_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=tis_cap) if tis_cap > 0 else ratio
    advantages = batch.advantages.unsqueeze(-1)
    unclipped = weight * advantages
    clipped = weight.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -(torch.minimum(unclipped, clipped) * mask).sum() / batch.loss_tokens
    with torch.no_grad():
        clip_active = (clipped < unclipped) & mask
        metrics = {
            "loss": loss.item(),
            "tokens": int(mask.sum()),
            "logprob_mismatch": float((log_ratio.abs() * mask).sum()),
            "ratio": float((ratio * mask).sum()),
            "ratio_max": float(ratio[mask].max()) if mask.any() else 0.0,
            "clip_low": int((clip_active & (ratio < 1)).sum()),
            "clip_high": int((clip_active & (ratio > 1)).sum()),
            "tis_truncated": int(((ratio > tis_cap) & mask).sum()) if tis_cap > 0 else 0,
        }
    return loss, metrics


class TitanTrainer(Actor):
    def __init__(self, config: TrainerConfig, weight_sync: WeightSyncConfig, checkpoint: str):
        pin_cpus(config.cpus, config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.checkpoint = Path(checkpoint)
        hf_weights = load_hf_weights(self.checkpoint)
        self.model, self.adapter = build_policy(read_hf_config(self.checkpoint))
        self.model.load_state_dict(self.adapter.from_hf(dict(hf_weights)))
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        # Publish in the checkpoint's own layout (HF names and dtype): what the generator loads.
        self.ring = WeightRing(WeightLayout.of_tensors(hf_weights), weight_sync.slots, weight_sync.chunk_mb,
                               weight_sync.checksums)
        self.policy_version = 0

    @endpoint
    async def forward_backward(self, batch: TrainBatch) -> dict:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16_autocast):
            logits = self.model(batch.input_ids)
        loss, metrics = ppo_clip_loss(token_logprobs(logits, batch.target_ids), batch, self.config.clip_eps,
                                      self.config.tis_cap)
        loss.backward()
        return metrics

    @endpoint
    async def optim_step(self) -> dict:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        return {"policy_version": self.policy_version, "grad_norm": float(grad_norm)}

    @endpoint
    async def weight_ring(self) -> RingHandle:
        """Where generators pull published weights from."""
        return self.ring.handle()

    @endpoint
    async def publish_weights(self) -> int:
        """Put the current policy into the weight ring (no waiting for readers); return its version."""
        self.ring.publish(self._hf_weights(), self.policy_version)
        return self.policy_version

    @endpoint
    async def save(self, path: str) -> None:
        """Write the current policy as an HF checkpoint (loadable by vLLM and transformers)."""
        save_checkpoint(self._hf_weights(), self.checkpoint, Path(path))

    @torch.no_grad()
    def _hf_weights(self) -> dict[str, torch.Tensor]:
        return self.adapter.to_hf(self.model.state_dict())
