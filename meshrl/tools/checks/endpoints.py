"""Section `endpoints` of `meshrl check gpu`: the trainer actor's endpoints on the device, one rank in a
process group of world 1 (NCCL on CUDA, gloo on the CPU), so the model is sharded with FSDP2 as on
several ranks: load, logprobs, forward_backward, optim_step, publish_weights into a real weight ring,
twice, each version read back from the ring as a generator reads it and compared, tensor by tensor, with
the trainer's state dict cast to the published dtype (equal bit for bit, or the section fails).
"""

from meshrl.tools.checks import standins, workloads

TOKENS, SEQUENCE = 512, 128  # the dry mode: a quarter of the tokens


def run(check) -> dict:
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshrl.models.model import read_hf_config, resolve_checkpoint

    checkpoint = resolve_checkpoint("tiny")
    began = time.perf_counter()
    config, _ = workloads.trainer_config(check.device, True)
    trainer = workloads.trainer(checkpoint, config)
    check.sync()
    out = {"model": "tiny (Llama)", "world": trainer.world, "process_group": dist.get_backend() if
           dist.is_initialized() else None, "fsdp2": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
           "published_dtype": str(trainer.dtype).removeprefix("torch."), "endpoint_s": {"load": time.perf_counter() - began}}
    batch = workloads.batch(TOKENS // 4 if check.dry else TOKENS, read_hf_config(checkpoint)["vocab_size"], seed=2,
                            sequence=SEQUENCE // 4 if check.dry else SEQUENCE)
    before, out["endpoint_s"]["logprobs"] = check.timed(workloads.on_batch(trainer, "logprobs", batch))
    problems = []
    if not bool(torch.isfinite(before).all()) or not bool((before[batch.loss_mask] < 0).all()):
        problems.append("logprobs: not all finite and negative on the loss positions")
    reads = []
    for round_ in (1, 2):
        metrics, fb_s = check.timed(workloads.on_batch(trainer, "forward_backward", batch))
        step, step_s = check.timed(standins.call(trainer, "optim_step"))
        version, publish_s = check.timed(standins.call(trainer, "publish_weights"))
        if round_ == 1:
            out["endpoint_s"] |= {"forward_backward": fb_s, "optim_step": step_s, "publish_weights": publish_s}
            out["loss"], out["grad_norm"] = metrics["loss"], step["grad_norm"]
        if step["skipped"] or step["updates"] != round_ or not torch.isfinite(torch.tensor(step["grad_norm"])):
            problems.append(f"optim_step {round_}: {step}")
        reads.append(read_back(check, trainer, version))
    after = check.run(workloads.on_batch(trainer, "logprobs", batch))
    out["logprob_change"] = float((after - before)[batch.loss_mask].abs().max())
    if out["logprob_change"] == 0:
        problems.append("two optimizer steps left the logprobs as they were")
    out["read_back"] = reads
    problems += [f"version {r['version']}: {r['unequal']} of {r['tensors']} tensors differ from the state dict"
                 for r in reads if r["unequal"]]
    if reads[0]["digest"] == reads[1]["digest"]:
        problems.append("versions 1 and 2 read back the same bytes")
    out["problems"] = problems
    out["status"] = "fail" if problems else "pass"
    del trainer
    workloads.free(check.device)
    return out


def read_back(check, trainer, version: int) -> dict:
    """Version `version` read from the trainer's ring as a generator on its host reads it, against the
    trainer's state dict cast to the published dtype."""
    import hashlib

    import torch

    from meshrl.actors.distributed import local
    from meshrl.weight_sync.ring import RingReader, pull_together

    handle = check.run(standins.call(trainer, "weight_ring"))
    got, (weights,) = check.run(pull_together([RingReader(handle, handle.layout, transport="shm")], -1, 50))
    state = trainer.model.state_dict()
    unequal, digest = 0, hashlib.sha256()
    for name, tensor in weights:
        expected = local(state[name]).detach().to(trainer.dtype).cpu()
        unequal += not torch.equal(tensor, expected)
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return {"version": version, "read": got, "tensors": len(weights), "unequal": unequal + (got != version),
            "bytes": handle.layout.nbytes, "digest": digest.hexdigest()[:16]}


def report(section: dict) -> list[str]:
    s = section["endpoint_s"]
    lines = [f"world {section['world']}, group {section['process_group']}, FSDP2 {section['fsdp2']}; "
             f"load {s['load']:.2f} s, logprobs {s['logprobs']:.3f} s, forward_backward {s['forward_backward']:.3f} s, "
             f"optim_step {s['optim_step']:.3f} s, publish_weights {s['publish_weights']:.3f} s"]
    for r in section["read_back"]:
        lines.append(f"version {r['version']}: {r['tensors']} tensors ({r['bytes'] / 1e6:.1f} MB "
                     f"{section['published_dtype']}) read back, {r['unequal']} unequal")
    lines += [f"problem: {p}" for p in section["problems"]]
    return lines
