"""Will it fit: each GPU's and each host's memory for a run's placement, before anything is spawned.

The GPU plan (meshrl/runtime/gpu_plan.py) says which GPUs hold which generator replicas and ranks but not
whether they fit; without this, a user learns it from an out-of-memory error minutes into the run. From the
model's HF config (the checkpoint's, or its published shape: meshrl/models/shapes.py), the placement, the GPU
plan and the memory switches, the plan counts, in GiB:

    GPU with a generator replica:  generator.memory_fraction x job.gpu_memory_gib (vLLM takes that share,
                                   KV cache included; it must hold the weights / TP and one sequence's KV)
    GPU with a trainer rank:       the larger of forward_backward's peak (meshrl/runtime/memory_estimate.py:
                                   fp32 weights, gradients and AdamW's moments over the ranks, FSDP2's
                                   gathered units, activations, logits) and the optimizer step's
                                   + the weight ring's slots x its rows (weight_sync.memory device)
                                   + the CUDA context and NCCL (PROCESS_GIB, est.)
    GPU with a reference rank:     its weights in reference.dtype, a logprobs pass's peak, the context
    host:                          the larger of loading (each rank's fp32 shard; a single rank reads the
                                   whole checkpoint and builds the model on the CPU) and running: the host
                                   ring's slots, the pinned staging, each replica's reader buffer, a relay

against job.gpu_memory_gib and job.host_memory_gib. `refuse_unfitting` raises one line naming the GPU or
host that overflows, by how much, and the cheapest change that makes it fit by the same estimate (in
order: activation checkpointing, a smaller micro-batch, LoRA, more trainer ranks); `plan_only` prints
the placement, the GPU plan and the table (`meshrl train --plan-only`). Only plans with GPUs are checked.
"""

import sys
from dataclasses import dataclass, field

from meshrl.configs.overrides import apply_overrides
from meshrl.losses import DEFAULT_CHUNK_TOKENS
from meshrl.models.memory import resolve as resolve_switches
from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import plan
from meshrl.runtime.memory_estimate import (Dtypes, Pass, Shape, optimizer_step, reference_peak,
                                            trainer_phases)

GIB = 2**30
PROCESS_GIB = 1.0  # est., not measured: a CUDA context and NCCL's buffers, which torch's allocator does not see
LORA_FIX = 16  # the adapter rank a refusal proposes
MOE_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"  # an MoE model's experts are no linear layers


@dataclass
class Budget:
    """A GPU, a host, or a replica's share of a GPU: what its processes take, against what it has."""

    name: str
    capacity: float  # GiB
    uses: list[tuple[str, float]] = field(default_factory=list)  # (what, GiB), running
    loading: list[tuple[str, float]] = field(default_factory=list)  # (what, GiB), while the ranks load

    @property
    def peak(self) -> list[tuple[str, float]]:
        """The uses of the larger moment: running, or loading."""
        return self.uses if sum(g for _, g in self.uses) >= sum(g for _, g in self.loading) else self.loading

    @property
    def total(self) -> float:
        return sum(g for _, g in self.peak)

    @property
    def over(self) -> float:
        return self.total - self.capacity

    def line(self) -> str:
        uses = "; ".join(f"{what} {gib:.1f}" for what, gib in self.peak)
        return f"{self.name}: {self.total:.1f} of {self.capacity:g} GiB: {uses}"


def _where(group: str) -> str:
    return f"each host of group {group!r}" if group else "the controller's host"


def _tokens(config) -> tuple[int, int]:
    """A micro-batch's padded positions at most and its trained ones: sequences of generator.max_model_len,
    generator.max_tokens of each trained (or trainer.micro_batch_tokens positions)."""
    g, t = config.generator, config.trainer
    tokens = t.micro_batch_tokens or t.micro_batch_size * g.max_model_len
    return tokens, tokens * g.max_tokens // g.max_model_len


def _trainer(config, shape: Shape, ring: str) -> tuple[float, str]:
    """A trainer rank's GiB on its GPU, and what they are."""
    t, ranks = config.trainer, config.trainer.ranks
    choice = resolve_switches("cuda", t.bf16_autocast, t.activation_checkpointing, t.bf16_all_gather)
    sharded = ranks > 1
    d = Dtypes(2 if sharded and choice.all_gather_dtype == "bfloat16" else 4, 2 if t.bf16_autocast else 4)
    trainable = shape.lora_params(t.lora.rank, t.lora.names()) if t.lora.rank else 0
    tokens, loss_tokens = _tokens(config)
    phases = trainer_phases(shape, Pass(tokens, loss_tokens, choice.activation_checkpointing,
                                        t.logprob_chunk_tokens, t.loss.entropy_coef > 0, trainable), d, ranks, sharded)
    phase = max(phases, key=phases.get)
    step = optimizer_step(shape, trainable, ranks)
    ring_bytes = config.weight_sync.slots * _published(config, shape) / ranks if ring == "device" else 0
    weights, state = 4 * shape.params() / ranks / GIB, 12 * (trainable or shape.params()) / ranks / GIB
    detail = (f"forward_backward {phases[phase] / GIB:.1f} at its {phase} ({tokens} tokens, "
              f"{choice.activation_checkpointing} checkpointing), optimizer step {step / GIB:.1f} (fp32 weights "
              f"{weights:.1f}, gradients and AdamW {state:.1f})"
              + (f", weight ring {ring_bytes / GIB:.1f}" if ring_bytes else "") + f", CUDA context {PROCESS_GIB:g}")
    return (max(phases[phase], step) + ring_bytes) / GIB + PROCESS_GIB, detail


def _reference(config, shape: Shape) -> tuple[float, str]:
    r = config.reference
    choice = resolve_switches("cuda", r.bf16_autocast, reference_dtype=r.dtype)
    d = Dtypes(2 if choice.reference_dtype == "bfloat16" else 4, 2 if r.bf16_autocast else 4)
    peak = reference_peak(shape, *_tokens(config), d, r.ranks, r.ranks > 1, DEFAULT_CHUNK_TOKENS) / GIB
    return peak + PROCESS_GIB, f"logprobs {peak:.1f} ({choice.reference_dtype} weights), CUDA context {PROCESS_GIB:g}"


def _published(config, shape: Shape) -> int:
    """Bytes of one published version: the whole model (or the LoRA adapter) in weight_sync.dtype."""
    t, dtype = config.trainer, config.weight_sync.dtype
    size = 4 if dtype == "float32" else 2  # auto: the checkpoint's (bf16 for every model here)
    return size * (shape.lora_params(t.lora.rank, t.lora.names()) if t.lora.rank else shape.params())


def _ring(config, gpus) -> str:
    """Where the weight ring's slots are: the GPU plan's weight_sync.memory (meshrl/weight_sync/device_ring.py
    `ring_memory`), or the config's."""
    ring = gpus.weight_memory or config.weight_sync.memory
    return "host" if ring == "auto" else ring  # not planned: the trainer keeps the ring in host memory


def capacities(job) -> tuple[float, float]:
    """(each GPU's, each host's) GiB: job.gpu_memory_gib and job.host_memory_gib, 0 meaning this host's own for
    local and process jobs (whose hosts are this machine), else 80 (an H100's or A100's) and 1024."""
    gpu, host = job.gpu_memory_gib, job.host_memory_gib
    here = job.kind in ("local", "process")
    if not gpu:
        import torch

        gpu = torch.cuda.get_device_properties(0).total_memory / GIB if here and torch.cuda.is_available() else 80.0
    if not host:
        import psutil

        host = psutil.virtual_memory().total / GIB if here else 1024.0
    return gpu, host


def memory_plan(config, placement: dict, gpus, hf: dict) -> list[Budget]:
    """Every GPU and host budget of the plan (none without a GPU plan)."""
    from meshrl.runtime.relays import relays_on

    if not (gpus.generators or gpus.trainer or gpus.reference):
        return []
    shape, ring = Shape.of(hf), _ring(config, gpus)
    gpu_gib, host_gib = capacities(config.job)
    published = _published(config, shape) / GIB
    budgets: dict[tuple, Budget] = {}  # GPUs by (group, index), then hosts by group

    def gpu(group: str, index: int) -> Budget:
        return budgets.setdefault((0, group, index), Budget(f"GPU {index} of {_where(group)}", gpu_gib))

    def host(group: str) -> Budget:
        return budgets.setdefault((1, group, 0), Budget(_where(group), host_gib))

    shares = []
    if gpus.generators:
        g, where = config.generator, placement["generator"]
        fraction = g.memory_fraction or gpus.memory_fraction
        tp = g.tensor_parallel_size
        need = [("weights", 2 * shape.params() / tp / GIB),
                ("KV cache of one sequence", shape.kv_cache_per_token() * g.max_model_len / tp / GIB)]
        for i in range(0, g.replicas, where.hosts):  # the replicas of a group's first host
            for index in map(int, gpus.generators[i].split(",")):
                gpu(where.group, index).uses.append((f"generator replica {i} (vLLM's {fraction:g})",
                                                     fraction * gpu_gib))
            shares.append(Budget(f"generator replica {i}'s share of its GPUs (generator.memory_fraction "
                                 f"{fraction:g})", fraction * gpu_gib, need))
        readers = where.procs_per_host * (0 if ring == "device" else published)
        relay = config.weight_sync.slots * published if relays_on(config, placement) else 0
        host(where.group).uses += [("generator replicas' read buffers", readers)] + ([("relay", relay)] * bool(relay))
    for role, ranks in (("trainer", gpus.trainer), ("reference", gpus.reference)):
        if not ranks:
            continue
        where, count = placement[role], getattr(config, role).ranks
        gib, detail = _trainer(config, shape, ring) if role == "trainer" else _reference(config, shape)
        for local, index in enumerate(ranks):
            gpu(where.group, index).uses.append((f"{role} rank {local} ({detail})", gib))
        load = (4 * shape.params() / count if count > 1 else 6 * shape.params()) / GIB  # a shard; whole: bf16 + fp32
        host(where.group).loading.append((f"{role} ranks loading", where.procs_per_host * load))
        if role == "trainer" and ring == "host":
            slots, per_host = config.weight_sync.slots, published * where.procs_per_host / count
            host(where.group).uses += [(f"weight ring {slots} x the host's rows", slots * per_host),
                                       ("pinned staging", per_host if config.weight_sync.staging != "pageable" else 0)]
    return [budgets[key] for key in sorted(budgets)] + shares


def lines(budgets: list[Budget], config) -> list[str]:
    gpu_gib, host_gib = capacities(config.job)
    head = f"memory (est., GiB; each GPU {gpu_gib:.1f} (job.gpu_memory_gib), each host {host_gib:.1f} " \
           "(job.host_memory_gib)):"
    return [head] + ["  " + b.line() for b in budgets]


def _planned(config, hf: dict, counts) -> list[Budget]:
    """The budgets of `config` placed and planned anew on hosts of `counts` GPUs (gpu_plan.plan_gpus's)."""
    placement = plan(config)
    return memory_plan(config, placement, plan_gpus(config, placement, counts), hf)


def _fits(config, hf: dict, counts) -> bool:
    try:
        return all(b.over <= 0 for b in _planned(config, hf, counts))
    except ValueError:  # a change the hosts' GPUs cannot place
        return False


def _fixes(config, budget: Budget, hf: dict) -> list[list[str]]:
    """Changes to try for `budget`'s overflow, cheapest first, as command-line overrides: for a rank's GPU
    activation checkpointing, then with it each smaller micro-batch, then LoRA (more ranks: `_more_ranks`)."""
    t = config.trainer
    if budget.name.startswith("generator"):
        return [["--generator.tensor_parallel_size", str(2 * config.generator.tensor_parallel_size)]]
    if not budget.name.startswith("GPU"):
        return [["--weight_sync.slots", "1"]] if config.weight_sync.slots > 1 else []
    off = resolve_switches("cuda", t.bf16_autocast, t.activation_checkpointing).activation_checkpointing == "off"
    checkpointing = ["--trainer.activation_checkpointing", "full"] if off else []
    fixes = [checkpointing] if off else []
    size = 0 if t.micro_batch_tokens else t.micro_batch_size // 2
    while size >= 1:
        fixes.append(checkpointing + ["--trainer.micro_batch_size", str(size)])
        size //= 2
    if not t.lora.rank:
        targets = MOE_LORA_TARGETS if Shape.of(hf).experts else t.lora.targets
        fixes.append(checkpointing + ["--trainer.lora.rank", str(LORA_FIX), "--trainer.lora.targets", targets])
    return fixes


def refusal(config, hf: dict, counts) -> str | None:
    """One line if a GPU or host cannot hold what the plan of `config` on hosts of `counts` GPUs (as
    gpu_plan.plan_gpus takes them) puts on it: the worst overflow, and the cheapest change that makes the
    whole plan fit by this estimate; else None."""
    budgets = [b for b in _planned(config, hf, counts) if b.over > 0]
    if not budgets:
        return None
    worst = max(budgets, key=lambda b: b.over)
    top = ", ".join(f"{w.split(' (')[0]} {g:.1f}" for w, g in sorted(worst.peak, key=lambda u: -u[1])[:3])
    line = (f"memory plan: {worst.name} needs {worst.total:.1f} GiB of its {worst.capacity:g} "
            f"({worst.over:.1f} over: {top})")
    for fix in _fixes(config, worst, hf):
        if _fits(apply_overrides(config, fix), hf, counts):
            return f"{line}; the cheapest change that fits: {' '.join(fix)}"
    on_gpu = worst.name.startswith("GPU")
    if on_gpu and (more := _more_ranks(config, hf)):
        return f"{line}; the cheapest change that fits: --trainer.ranks {more} (a GPU each, no generator beside)"
    tried = "checkpointing, micro-batch, LoRA or trainer ranks" if on_gpu else "weight_sync.slots"
    bigger = "larger GPUs (job.gpu_memory_gib)" if on_gpu else "hosts with more memory (job.host_memory_gib)"
    return f"{line}; no change of {tried} fits by this estimate: {bigger}"


def _more_ranks(config, hf: dict) -> int | None:
    """The fewest trainer ranks (doubling, up to 1024) whose rank fits a GPU to itself (the weight ring on
    the host: the ranks then span hosts)."""
    ranks = config.trainer.ranks * 2
    while ranks <= 1024:
        bigger = apply_overrides(config, ["--trainer.ranks", str(ranks)])
        if _trainer(bigger, Shape.of(hf), "host")[0] <= capacities(config.job)[0]:
            return ranks
        ranks *= 2
    return None


def refuse_unfitting(config, hf: dict, counts) -> None:
    """ValueError (one line) if the plan cannot fit; nothing without GPUs (meshrl/runtime/run.py calls it
    before anything is spawned)."""
    config.job.check()
    if line := refusal(config, hf, counts):
        raise ValueError(line)


def plan_only(config) -> int:
    """`meshrl train --plan-only`: the placement, the GPU plan and the memory plan of a checked config, from
    the checkpoint's config.json or its published shape, no GPU needed; 0 if it fits, else the one
    refusal line and 1."""
    from meshrl.configs import resolve
    from meshrl.models.shapes import hf_config
    from meshrl.runtime.jobs import describe, gpus_per_host

    config.check()
    config.job.check()
    config = resolve(config)
    counts = gpus_per_host(config.job)
    placement = plan(config)
    gpus = plan_gpus(config, placement, counts)
    print("\n".join(describe(config, placement) + gpus.describe()))
    if gpus.asked:
        print("memory: not planned: the hosts' GPUs are known only at the start (set job.gpus_per_host)")
        return 0
    hf = hf_config(config.model.source)
    budgets = memory_plan(config, placement, gpus, hf)
    if not budgets:
        print("memory: nothing to plan (no GPUs)")
        return 0
    print("\n".join(lines(budgets, config)))
    if line := refusal(config, hf, counts):
        print(f"meshrl: error: {line}", file=sys.stderr)
        return 1
    fullest = max(budgets, key=lambda b: b.total / b.capacity)
    print(f"memory: fits (the fullest: {fullest.name}, {fullest.total:.1f} of {fullest.capacity:g} GiB)")
    return 0
