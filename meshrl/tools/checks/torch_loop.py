"""The smoke section's RL loop with torch alone (meshrl/tools/checks/smoke.py runs it where vLLM or Monarch is
missing, as on a lent GPU machine, and in the dry mode): a few asynchronous steps of sum_digits over the
stand-ins, every role an in-process object, so a machine with torch and CUDA only runs generation, grading,
training and the weight sync of a run end to end.

- The generator: meshrl/actors/torch_generator.py's TorchGenerator (the trainer's own torchtitan model, its KV
  cache engine), attached to the trainer's weight ring, each version loaded by `pull_weights`.
- The trainer: meshrl/actors/trainer.py's TitanTrainer as the endpoints section drives it (its config
  workloads.trainer_config's, publishing in the dtype the generator serves), one rank in the check's process
  group of world 1, its micro-batches fed by reference from
  workloads.HeldBatches in the replay buffer's place, cut by meshrl/train_step.py's `micro_batches` and
  collated by `TrainBatch.collate` as the buffer does.
- The controller's part: the task's prompts in the chat template, the completions scored by sum_digits' own
  reward, GRPO group advantages (meshrl/advantages.py, the controller's defaults), episodes made by
  meshrl/episodes.py's `episode`.
- Asynchrony as controller.max_policy_age 1: step k+1's groups are generated (min_version k - 1) before step
  k trains, so each step trains on groups one version behind the trainer's; after its publish the generator
  pulls the new version.

Model: on a GPU, a random Qwen3 of Qwen3-1.7B's published shape (meshrl/models/shapes.py) over the tiny
models' 49,152-token vocabulary (SmolLM2's tokenizer: every sampled id decodes), 1.5B parameters, built once
per check; in the dry mode the tiny Qwen3 (`tiny_qwen3`).
"""

import time
from pathlib import Path

import torch

from meshrl.tools.checks import standins, workloads

PATH = "torch generator over in-process stand-ins"
SHAPE = "Qwen3-1.7B"  # the published shape of the GPU's model
# steps, prompts a step, completions a prompt, tokens a completion: on a GPU, and in the dry mode
SIZES, DRY_SIZES = (4, 8, 8, 128), (3, 2, 4, 16)
KV_CACHE_GIB, MAX_MODEL_LEN = 8, 512  # on a GPU: KV slots for every sequence of a step at once


def qwen3_checkpoint(check) -> Path:
    """The loop's model: in the dry mode the tiny Qwen3; else a random Qwen3 of `SHAPE` over the tiny Qwen3's
    vocabulary and tokenizer, initialised by torchtitan on the device and saved (bf16) once per check
    (`check.cache["qwen3"]`)."""
    from meshrl.models.model import build_policy, read_hf_config, resolve_checkpoint, save_checkpoint
    from meshrl.models.shapes import PUBLISHED

    tiny = resolve_checkpoint("tiny_qwen3")
    if check.dry:
        return tiny
    if "qwen3" not in check.cache:
        shape = PUBLISHED[SHAPE]
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
        config = read_hf_config(tiny) | {k: shape[k] for k in keys} | {
            "rope_parameters": {"rope_theta": shape["rope_theta"], "rope_type": "default"},
            "layer_types": ["full_attention"] * shape["num_hidden_layers"]}
        torch.manual_seed(0)
        with torch.device(check.device):
            model, adapter = build_policy(config)
            model.init_states(buffer_device=check.device)
        out = check.tmp / "qwen3"
        save_checkpoint(adapter.to_hf(model.state_dict()), tiny, out, config)
        del model
        workloads.free(check.device)
        check.cache["qwen3"] = out
    return check.cache["qwen3"]


def generator(check, checkpoint: Path, dtype: str, tokens: int):
    """The torch generator on `checkpoint`, in this process, on the check's device (in the dry mode the CPU, even
    where CUDA is): a GPU where `generator.devices` names one, as the run's GPU plan would."""
    from meshrl.actors import torch_generator
    from meshrl.actors.generator_config import GeneratorConfig
    from meshrl.weight_sync import WeightSyncConfig

    config = GeneratorConfig(impl="torch", dtype=dtype, weight_update="in_flight", max_tokens=tokens,
                             num_threads=workloads.threads(), max_model_len=MAX_MODEL_LEN,
                             kv_cache_gib=1 if check.dry else KV_CACHE_GIB,
                             devices=str(check.device.index or 0) if check.device.type == "cuda" else "")
    return torch_generator.TorchGenerator(config, WeightSyncConfig(dtype=dtype), str(checkpoint))


def run(check) -> dict:
    from meshrl.actors.engine import vllm_dtype
    from meshrl.actors.trainer import TitanTrainer
    from meshrl.weight_sync import WeightSyncConfig

    steps, prompts, n, tokens = DRY_SIZES if check.dry else SIZES
    checkpoint = qwen3_checkpoint(check)
    # what the generator serves and the trainer publishes: on a GPU its own choice (bf16 where it has it)
    dtype = vllm_dtype("auto") if check.device.type == "cuda" else "float32"
    began = time.perf_counter()
    gen = generator(check, checkpoint, dtype, tokens)
    config, _ = workloads.trainer_config(check.device, True)
    trainer = TitanTrainer(config, WeightSyncConfig(dtype=dtype), str(checkpoint))
    check.sync()
    out = {"path": PATH, "model": f"random Qwen3 ({SHAPE} shape)" if not check.dry else "tiny Qwen3 (dry mode)",
           "parameters": sum(p.numel() for p in trainer.model.parameters()), "generator_device": str(gen.device),
           "trainer_device": str(trainer.device), "generator_dtype": dtype, "load_s": time.perf_counter() - began,
           "sizes": {"steps": steps, "prompts": prompts, "completions": n, "max_tokens": tokens},
           "max_policy_age": 1}
    try:
        out |= Loop(check, gen, trainer, checkpoint, prompts, n).run(steps)
    finally:
        del gen, trainer
        workloads.free(check.device)
    out["status"] = "fail" if out["problems"] else "pass"
    return out


class Loop:
    """The run's roles around one generator and one trainer rank, in this process: the controller's prompts and
    groups, the grader's reward, the replay buffer's micro-batches."""

    def __init__(self, check, gen, trainer, checkpoint: Path, prompts: int, n: int):
        from meshrl.advantages import estimator
        from meshrl.configs import ControllerConfig
        from meshrl.models.model import ChatTokenizer
        from meshrl.tasks.sum_digits import SumDigits, SumDigitsConfig

        self.check, self.gen, self.trainer, self.prompts = check, gen, trainer, prompts
        self.task, self.tokenizer = SumDigits(SumDigitsConfig()), ChatTokenizer(checkpoint)
        controller = ControllerConfig()  # the run's defaults: GRPO and its eps
        self.advantages, self.eps = estimator(controller.advantage), controller.advantage_eps
        self.sampling = gen.config.sampling(n)
        self.pulls: list[dict] = []  # the generator's loads, as its reports list them

    def call(self, actor, endpoint: str, *args, **kwargs):
        return self.check.run(standins.call(actor, endpoint, *args, **kwargs))

    def run(self, steps: int) -> dict:
        """`steps` steps, each training the groups generated before the previous step trained; the figures."""
        transport = self.call(self.gen, "attach_weights", [self.call(self.trainer, "weight_ring")])
        rows, problems = [], []
        pending = self.generate(0, 0)
        for step in range(1, steps + 1):
            ahead = self.generate(step, step - 1) if step < steps else None  # the next step's, one version behind
            row = {"step": step, **train_step(self.check, self.trainer, pending, self.task, self.advantages, self.eps,
                                              self.sampling.temperature, self.tokenizer.pad_id)}
            row["published"], row["publish_s"] = self.check.timed(standins.call(self.trainer, "publish_weights"))
            row["loaded"], row["pull_weights_s"] = self.check.timed(standins.call(self.gen, "pull_weights"))
            self.pulls += self.call(self.gen, "weight_updates")["pulls"]
            if row["tokens_trained"] <= 0:
                problems.append(f"step {step} trained no token")
            if row["loaded"] != row["published"]:
                problems.append(f"step {step} published version {row['published']}, the generator serves "
                                f"{row['loaded']}")
            if row["policy_age_max"] > 1:
                problems.append(f"step {step} trained groups {row['policy_age_max']} versions old (max_policy_age 1)")
            rows.append(row)
            pending = ahead
        out = {"transport": transport, "steps": rows, **figures(rows, self.pulls)}
        missing = sorted(set(out["versions_published"]) - set(out["versions_loaded"]))
        if missing:
            problems.append(f"versions published and never loaded: {missing}")
        if [load["version"] for load in out["loads"]] != out["versions_published"]:
            problems.append(f"the generator's loads {[x['version'] for x in out['loads']]} are not the versions "
                            "published")
        return out | {"problems": problems}

    def generate(self, batch: int, min_version: int) -> dict:
        """Batch `batch`'s prompts (the task's training samples in the chat template), `sampling.n` completions
        each from version `min_version` or newer, taken from the generator as the replay buffer takes them."""
        from meshrl.types import Prompt

        samples = [self.task.train_sample(batch * self.prompts + i) for i in range(self.prompts)]
        asked = [Prompt(i, self.tokenizer.encode_chat(s.prompt)) for i, s in enumerate(samples)]
        made, seconds = self.check.timed(standins.call(self.gen, "generate", asked, sampling=self.sampling,
                                                       min_version=min_version))
        self.pulls += made.report["pulls"]
        completions = self.call(self.gen, "completions", [g.key for g in made.completions], forget=True)
        return {"samples": samples, "completions": completions, "seconds": seconds, "min_version": min_version,
                "busy_s": made.report["busy_s"], "tokens": sum(len(c.token_ids) for c in completions)}


def train_step(check, trainer, batch: dict, task, advantages, eps: float, temperature: float, pad_id: int) -> dict:
    """One step on a generated batch as a run trains it: each prompt's completions scored by the task's reward,
    GRPO advantages within the group, one episode each; micro-batches fed to the trainer by reference as the
    replay buffer's, then one optimizer step."""
    from meshrl.episodes import episode
    from meshrl.train_step import micro_batches
    from meshrl.types import TrainBatch

    groups: dict[int, list] = {}
    for c in batch["completions"]:
        groups.setdefault(c.prompt_index, []).append(c)
    episodes, rewards = [], []
    for index, group in sorted(groups.items()):
        scored = [task.reward(c.text, batch["samples"][index].answer)[0] for c in group]
        rewards += scored
        episodes += [episode([c], a, index, temperature) for c, a in zip(group, advantages(scored, eps))]
    versions = [e.policy_version for e in episodes]
    tokens, losses, fb_s = 0, 0.0, 0.0
    for micro in micro_batches(episodes, trainer.config.micro_batch_size, trainer.config.micro_batch_tokens):
        metrics, seconds = check.timed(workloads.on_batch(trainer, "forward_backward", TrainBatch.collate(
            *micro, pad_id)))
        tokens, losses, fb_s = tokens + metrics["tokens"], losses + metrics["loss"], fb_s + seconds
    update, optim_s = check.timed(standins.call(trainer, "optim_step"))
    return {"groups": len(groups), "episodes": len(episodes), "generated_tokens": batch["tokens"],
            "generate_s": batch["seconds"], "generator_busy_s": batch["busy_s"], "min_version": batch["min_version"],
            "sampled_versions": sorted(set(versions)), "policy_age_max": trainer.policy_version - min(versions),
            "reward_mean": sum(rewards) / len(rewards), "rewards": rewards, "tokens_trained": tokens,
            "loss": losses, "forward_backward_s": fb_s, "optim_step_s": optim_s, "grad_norm": update["grad_norm"],
            "updates": update["updates"]}


def figures(rows: list[dict], pulls: list[dict]) -> dict:
    """The loop's rates and the weight loads, from its steps' rows and the generator's reports of its loads."""
    generated = sum(r["generated_tokens"] for r in rows)
    generate_s = sum(r["generate_s"] for r in rows)
    trained = sum(r["tokens_trained"] for r in rows)
    train_s = sum(r["forward_backward_s"] + r["optim_step_s"] for r in rows)
    loads = [{"version": p["version"], "seconds": p["end"] - p["start"], "read_s": p["read_s"]} for p in pulls]
    return {"steps_run": len(rows), "generated_tokens": generated, "generate_s": generate_s,
            "generated_tokens_per_s": generated / generate_s if generate_s else 0.0, "tokens_trained": trained,
            "train_s": train_s, "trained_tokens_per_s": trained / train_s if train_s else 0.0,
            "versions_published": [r["published"] for r in rows], "versions_loaded": [r["loaded"] for r in rows],
            "loads": loads, "load_s_per_version": sum(x["seconds"] for x in loads) / len(loads) if loads else None,
            "rewards_per_step": [round(r["reward_mean"], 4) for r in rows]}


def report(section: dict) -> list[str]:
    s = section
    load = s["load_s_per_version"]
    lines = [f"{s['path']}: {s['model']}, {s['parameters'] / 1e9:.3g}B parameters; generator on "
             f"{s['generator_device']} ({s['generator_dtype']}), trainer on {s['trainer_device']}; weights by "
             f"{s['transport']}; loaded in {s['load_s']:.1f} s",
             f"{s['steps_run']} steps of {s['sizes']['prompts']} prompts x {s['sizes']['completions']} completions "
             f"x {s['sizes']['max_tokens']} tokens, max_policy_age {s['max_policy_age']}: generated "
             f"{s['generated_tokens_per_s']:.1f} tokens/s, trained {s['trained_tokens_per_s']:.1f} tokens/s "
             f"(forward_backward + optim_step)",
             f"versions published {s['versions_published']}, loaded {s['versions_loaded']}, "
             + (f"{load:.3f} s per version loaded" if load is not None else "none loaded"),
             f"rewards per step {s['rewards_per_step']}"]
    return lines + [f"problem: {p}" for p in s["problems"]]
