"""Which GPUs each process takes on a host: generator replicas and trainer (and reference) ranks.

On a host with G GPUs the generator replicas placed there (round-robin over their group's hosts, as
meshrl/runtime/jobs.py places them) take disjoint sets of `generator.tensor_parallel_size` GPUs each, from GPU 0
up; the trainer's ranks take the next GPUs, one each, and the reference's ranks the ones after, when
they share a host with the generators. So 8 GPUs host 8 replicas of TP 1, or 2 of TP 4, or 4 replicas
of TP 1 beside 4 trainer ranks; on two hosts, a group of generator replicas on one and the trainer's 8
ranks on the other. A replica is given its GPUs through CUDA_VISIBLE_DEVICES, set in its process before
vLLM starts (`generator.devices`); a rank gets `cuda:N` (`trainer.device`).

Sharing (`job.gpu_sharing auto`, the default): where a host has too few GPUs for one per process, the
roles share them, each role's processes still on GPUs of their own (NCCL refuses two ranks on one GPU,
and a replica's GPUs are its own): the ranks go on from where the replicas end, wrapping around to GPU 0.
So one GPU holds the generator, the trainer and the reference of a smoke run. A generator sharing its GPUs
takes GPU_MEMORY_FRACTION split evenly between the processes on its busiest GPU (`generator.memory_fraction`,
unless set), leaving the rest to the ranks, and with synchronous training (controller.max_policy_age 0)
sleeps while a step trains (vLLM's sleep mode, `generator.engine.sleep auto`). `off`: one GPU per process,
else an error. Where even sharing cannot work (a replica of TP 4 on a host of 2 GPUs, more ranks of one role
on a host than it has GPUs) the plan is one clear error either way.

Pure: it computes the plan from the config, the placement and the GPUs of each group's hosts; `launch`
applies it. Where hosts have no GPUs (this machine) the plan is empty and nothing changes.
"""

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from meshrl.actors.engine import GPU_MEMORY_FRACTION
from meshrl.runtime.jobs import RolePlacement
from meshrl.weight_sync.device_ring import ring_memory

SHARING = ("auto", "on", "off")  # on: as auto (what meshrl/runtime/settle.py writes where auto shared)


@dataclass(frozen=True)
class GpuPlan:
    generators: list[str]  # replica i's CUDA_VISIBLE_DEVICES ("0,1"); empty: no plan
    trainer: list[int]  # the GPU of each rank on its host (by local rank); empty: no plan
    reference: list[int]
    memory_fraction: float = 0.0  # the generators' share of each of their GPUs; 0: not planned
    shared: list[str] = field(default_factory=list)  # per group whose roles share GPUs: what shares them
    sleep: bool = False  # the generators share GPUs with ranks: vLLM's sleep mode while a synchronous step trains
    asked: bool = False  # not planned yet: the hosts are asked for their GPUs once attached (job.kind workers)
    weight_memory: str = ""  # weight_sync.memory for this placement (device_ring.ring_memory); "": not planned

    def apply(self, config):
        """The config with the plan written into the roles' device settings (their own settings win:
        `generator.devices` or `generator.memory_fraction` set by the user, `generator.engine.sleep` other
        than auto, or a `trainer.device` other than auto)."""
        changes = {}
        if self.weight_memory:
            changes["weight_sync"] = dataclasses.replace(config.weight_sync, memory=self.weight_memory)
        g = config.generator
        if self.generators:
            sleep = "on" if self.sleep and config.controller.max_policy_age == 0 else "off"
            changes["generator"] = dataclasses.replace(
                g, devices=g.devices or ";".join(self.generators), memory_fraction=g.memory_fraction or self.memory_fraction,
                engine=dataclasses.replace(g.engine, sleep=sleep if g.engine.sleep == "auto" else g.engine.sleep))
        for role in ("trainer", "reference"):
            section = getattr(config, role)
            if getattr(self, role) and section.device == "auto":
                changes[role] = dataclasses.replace(section, device=";".join(f"cuda:{g}" for g in getattr(self, role)))
        return dataclasses.replace(config, **changes)

    def describe(self) -> list[str]:
        if self.asked:
            return ["gpus: planned at the start, from the GPUs each host reports (job.gpus_per_host sets them)"]
        if not (self.generators or self.trainer or self.reference):
            return ["gpus: none (every role on the CPU)"]
        lines = []
        if self.generators:
            lines.append("gpus: generator replicas' CUDA_VISIBLE_DEVICES, replica 0 first: " + " | ".join(self.generators))
        lines += [f"gpus: {role} ranks on each host, local rank 0 first: " + " ".join(f"cuda:{g}" for g in gpus)
                  for role, gpus in (("trainer", self.trainer), ("reference", self.reference)) if gpus]
        lines += [f"gpus: shared (job.gpu_sharing auto): {what}" for what in self.shared]
        if self.shared and self.generators:
            lines.append(f"gpus: vLLM takes {self.memory_fraction:.2f} of each GPU it shares (generator.memory_fraction"
                         " unless set)" + ("; it sleeps while a synchronous step trains (generator.engine.sleep auto)"
                                           if self.sleep else ""))
        if self.weight_memory == "device":
            lines.append("gpus: the weight ring's slots in the trainer's GPU memory, read by the generators by CUDA IPC "
                         "(weight_sync.memory)")
        return lines


def plan_gpus(config, placement: dict[str, RolePlacement], gpus_per_host: int | dict[str, int] | None) -> GpuPlan:
    """The GPUs of every generator replica and rank, given each host's GPUs: one count for every host, or
    one per host group ("": the controller's host; a group not named has none), or None: not known until
    the hosts are asked (an empty plan that says so). ValueError (one line) if a host has too few, even shared."""
    if gpus_per_host is None:
        return GpuPlan([], [], [], asked=True)
    counts = gpus_per_host if isinstance(gpus_per_host, dict) else {p.group: gpus_per_host for p in placement.values()}
    sharing = config.job.gpu_sharing
    if sharing not in SHARING:
        raise ValueError(f"unknown job.gpu_sharing {sharing!r}; known: {', '.join(SHARING)}")
    tp = config.generator.tensor_parallel_size
    # each group's processes per host, in the order they take GPUs: (role, processes, GPUs each)
    placed: dict[str, list[tuple[str, int, int]]] = {}
    for role in ("generator", "trainer", "reference"):
        if role in placement and counts.get(placement[role].group, 0) > 0:
            p = placement[role]
            placed.setdefault(p.group, []).append((role, p.procs_per_host, tp if role == "generator" else 1))
    gpus_of: dict[str, list[list[int]]] = {}  # role -> each process's GPUs on its host
    load: dict[str, Counter] = {}  # group -> processes on each GPU of a host
    shared, shared_ranks = [], False
    for group, roles in placed.items():
        have, where = counts[group], f"group {group!r}" if group else "the controller's host"
        held = [f"{_n(n, 'generator replica')} x tensor_parallel_size {each}" if role == "generator"
                else _n(n, f"{role} rank") for role, n, each in roles]
        need = sum(n * each for _, n, each in roles)
        if need > have and sharing == "off":
            raise ValueError(f"each host of {where} has {_n(have, 'GPU')}; the processes placed there need {need} "
                             f"({', '.join(held)}, one GPU per rank; job.gpu_sharing auto lets the roles share them)")
        for role, n, each in roles:
            if each > have:
                raise ValueError(f"generator.tensor_parallel_size {each}: a replica needs {each} GPUs of one host, "
                                 f"and each host of {where} has {have}")
            if n * each > have:  # NCCL refuses two ranks on one GPU; a replica's GPUs are its own
                raise ValueError(f"each host of {where} has {_n(have, 'GPU')} and {', '.join(held)}: the {role}'s "
                                 f"{n * each} need GPUs of their own, even shared; place fewer on a host, or on more hosts")
        cursor, load[group] = 0, Counter()
        for role, n, each in roles:
            gpus_of[role] = [[(cursor + i * each + k) % have for k in range(each)] for i in range(n)]
            cursor += n * each
            load[group].update(g for gpus in gpus_of[role] for g in gpus)
        if need > have:
            shared.append(f"each host of {where} has {_n(have, 'GPU')} for {', '.join(held)}")
            shared_ranks |= "generator" in gpus_of and any(
                load[group][g] > 1 for gpus in gpus_of["generator"] for g in gpus)
    generators, fraction = [], 0.0
    if "generator" in gpus_of:
        gen = placement["generator"]
        # replica i runs on host i % hosts of its group; on its host it is the (i // hosts)-th replica
        generators = [",".join(map(str, gpus_of["generator"][i // gen.hosts])) for i in range(config.generator.replicas)]
        busiest = max(load[gen.group][g] for gpus in gpus_of["generator"] for g in gpus)
        fraction = round(GPU_MEMORY_FRACTION / busiest, 4)
    trainer, memory = placement.get("trainer"), ""  # planned only with the trainer on GPUs (auto: host otherwise)
    if trainer is not None and "generator" in placement:
        resolved = ring_memory(config.weight_sync.memory, "trainer" in gpus_of, trainer.hosts,
                               placement["generator"].group == trainer.group, config.weight_sync.relay,
                               lora=config.trainer.lora.rank > 0)
        memory = resolved if "trainer" in gpus_of else ""
    return GpuPlan(generators, [g for [g] in gpus_of.get("trainer", [])], [g for [g] in gpus_of.get("reference", [])],
                   fraction, shared, shared_ranks, weight_memory=memory)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"
