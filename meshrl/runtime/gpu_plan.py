"""Which GPUs each process takes on a host: generator replicas and trainer (and reference) ranks.

On a host with G GPUs the generator replicas placed there (round-robin over their group's hosts, as
meshrl/runtime/jobs.py places them) take disjoint sets of `generator.tensor_parallel_size` GPUs each, from GPU 0
up; the trainer's ranks take the next GPUs, one each, and the reference's ranks the ones after, when
they share a host with the generators. So 8 GPUs host 8 replicas of TP 1, or 2 of TP 4, or 4 replicas
of TP 1 beside 4 trainer ranks. A replica is given its GPUs through CUDA_VISIBLE_DEVICES, set in its
process before vLLM starts (`generator.devices`); a rank gets `cuda:N` (`trainer.device`).

Pure: it computes the plan from the config, the placement and the GPUs per host; `launch` applies it.
Where hosts have no GPUs (this machine) the plan is empty and nothing changes.
"""

import dataclasses
from dataclasses import dataclass

from meshrl.runtime.jobs import RolePlacement


@dataclass(frozen=True)
class GpuPlan:
    generators: list[str]  # replica i's CUDA_VISIBLE_DEVICES ("0,1"); empty: no plan
    trainer: list[int]  # the GPU of each rank on its host (by local rank); empty: no plan
    reference: list[int]

    def apply(self, config):
        """The config with the plan written into the roles' device settings (their own settings win:
        `generator.devices` set by the user, or a `trainer.device` other than auto)."""
        changes = {}
        if self.generators and not config.generator.devices:
            changes["generator"] = dataclasses.replace(config.generator, devices=";".join(self.generators))
        for role in ("trainer", "reference"):
            section = getattr(config, role)
            if getattr(self, role) and section.device == "auto":
                changes[role] = dataclasses.replace(section, device=";".join(f"cuda:{g}" for g in getattr(self, role)))
        return dataclasses.replace(config, **changes)

    def describe(self) -> list[str]:
        if not (self.generators or self.trainer):
            return ["gpus: none (every role on the CPU)"]
        lines = ["gpus: generator replicas' CUDA_VISIBLE_DEVICES, replica 0 first: " + " | ".join(self.generators)]
        lines += [f"gpus: {role} ranks on each host, local rank 0 first: " + " ".join(f"cuda:{g}" for g in gpus)
                  for role, gpus in (("trainer", self.trainer), ("reference", self.reference)) if gpus]
        return lines


def plan_gpus(config, placement: dict[str, RolePlacement], gpus_per_host: int) -> GpuPlan:
    """The GPUs of every generator replica and rank; ValueError (one line) if a host has too few."""
    if gpus_per_host <= 0:
        return GpuPlan([], [], [])
    tp = config.generator.tensor_parallel_size
    gen = placement["generator"]
    # replica i runs on host i % hosts of its group; on its host it is the (i // hosts)-th replica
    generators = [",".join(str((i // gen.hosts) * tp + k) for k in range(tp)) for i in range(config.generator.replicas)]
    used, held = {}, {}  # GPUs taken on every host of a group by the roles placed before; what they are
    if config.generator.replicas:
        used[gen.group] = gen.procs_per_host * tp
        held[gen.group] = [f"{gen.procs_per_host} generator replicas x tensor_parallel_size {tp}"]
    ranks = {}
    for role in ("trainer", "reference"):
        if role not in placement:
            ranks[role] = []
            continue
        p = placement[role]
        first = used.get(p.group, 0)
        ranks[role] = list(range(first, first + p.procs_per_host))
        used[p.group] = first + p.procs_per_host
        held.setdefault(p.group, []).append(f"{p.procs_per_host} {role} ranks")
    for group, need in used.items():
        if need > gpus_per_host:
            where = f"group {group!r}" if group else "the controller's host"
            raise ValueError(f"each host of {where} has {gpus_per_host} GPUs; the processes placed there need "
                             f"{need} ({', '.join(held[group])}, one GPU per rank)")
    return GpuPlan(generators, ranks["trainer"], ranks["reference"])
