"""A run's dtypes, decided once at its start, before any actor starts: vLLM's for the generators and the
judge (`dtype auto`), the published weights' (`weight_sync.dtype auto`: what the generators serve, so the
served policy is exactly the trained one, not a rounded copy; float32 and the trainer's autocast rule with
generator.exact) and the trainer's and reference's bf16
autocast. meshrl/actors/dtypes.py holds the rule; this module asks it on each role's host (here, or a
probe actor on the role's first host) with the role's device and threads, and writes the answers into the
config the actors are started with. The recipe's hash was taken before: it stays that of the user's
settings. The run prints the choices (`describe`) and writes them to summary.json (`Dtypes.summary`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from monarch.actor import Actor, endpoint

from meshrl.actors import resolve_device, spawn
from meshrl.actors.dtypes import Bf16Choice, bf16_choice

VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other names for them
FOLLOWS = "what the generators serve"


class DtypeProbe(Actor):
    """Asked on a role's host what its device computes in there (its hardware decides `auto`)."""

    @endpoint
    async def choice(self, device: str, threads: int) -> dict:
        return bf16_choice(resolve_device(device), threads).to_dict()


@dataclass
class Dtypes:
    """Each role's dtype and why: {role: {"dtype": ..., "reason": ..., the figures measured}}."""

    roles: dict[str, dict] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """One line per reason: "dtype: generator bfloat16, trainer bf16 autocast (bf16 matmul ... )"; the
        published weights' when they follow the generators' go without saying."""
        reasons: dict[str, list[str]] = {}
        for role, chosen in self.roles.items():
            if chosen["reason"] == FOLLOWS:
                continue
            reasons.setdefault(chosen["reason"], []).append(f"{role} {chosen['dtype']}")
        return [f"dtype: {', '.join(roles)} ({reason})" for reason, roles in reasons.items()]

    def summary(self) -> dict:
        return self.roles


def wanted(config, placement: dict, roles: set[str]) -> dict[str, tuple[str, str, int]]:
    """Of the run's `roles` (with "judge" where the graders serve a judge model), those whose dtype is
    `auto` (autocast on, for the trainer and reference): {role: (host group, device, threads)}.
    `config` has the GPU plan applied: the trainer's and reference's devices are planned."""
    asks = {}
    if config.generator.dtype == "auto":  # vLLM's device: a GPU where its process sees one
        asks["generator"] = (placement["generator"].group, "auto", config.generator.num_threads)
    if "judge" in roles and config.grader.judge.dtype == "auto":
        asks["judge"] = (placement["grader"].group, "auto", config.grader.judge.num_threads)
    for role in ("trainer", "reference"):
        section = getattr(config, role)
        if role in roles and section.bf16_autocast:
            asks[role] = (placement[role].group, section.device.split(";")[0], section.num_threads)
    return asks


def run_roles(classes: dict[str, type]) -> set[str]:
    """The roles a run starts (its actor classes), with "judge" where the grader is the judge."""
    from meshrl.actors.judge import JudgeGrader

    return set(classes) | ({"judge"} if issubclass(classes["grader"], JudgeGrader) else set())


async def choose_dtypes(config, placement: dict, hosts, roles: set[str], planned=None) -> Dtypes:
    """Each `auto` decided on its role's host, written into `config` (generator.dtype, weight_sync.dtype,
    grader.judge.dtype, trainer.bf16_autocast, reference.bf16_autocast); what each role got and why.
    `roles`: run_roles; `planned`: `config` with the GPU plan applied (the trainer's and reference's devices)."""
    asks = wanted(planned or config, placement, roles)
    choices, probes = {}, {}
    for role, (group, device, threads) in asks.items():
        if not group:  # the controller's own host
            choices[role] = bf16_choice(resolve_device(device), threads)
        elif group not in probes:
            placed = "grader" if role == "judge" else role  # the judge is served in each grader replica
            probes[group] = spawn(f"dtype_probe_{group}", DtypeProbe, host=hosts.host(placed, 0))
    try:  # each other host asked at once
        remote = [(role, probes[group][1].choice.call_one(device, threads))
                  for role, (group, device, threads) in asks.items() if group]
        for (role, _), answer in zip(remote, await asyncio.gather(*(call for _, call in remote))):
            choices[role] = Bf16Choice(**answer)
    finally:
        await asyncio.gather(*(procs.stop() for procs, _ in probes.values()), return_exceptions=True)
    return apply(config, choices, roles)


def apply(config, choices: dict[str, Bf16Choice], roles: set[str]) -> Dtypes:
    """`choices` written into `config`'s `auto` fields; each role's dtype and why (a setting the user made
    is its own reason)."""
    chosen = {}

    def note(role: str, dtype: str, choice: Bf16Choice | None, setting: str):
        chosen[role] = ({"dtype": dtype, **{k: v for k, v in choice.to_dict().items() if k != "bf16"}} if choice
                       else {"dtype": dtype, "reason": f"set by {setting}"})

    g = config.generator
    if g.dtype == "auto":
        g.dtype = choices["generator"].dtype
        note("generator", g.dtype, choices["generator"], "")
    else:
        note("generator", g.dtype, None, "generator.dtype")
    if config.weight_sync.dtype == "auto":
        config.weight_sync.dtype = VLLM_DTYPES.get(g.dtype, g.dtype)
        chosen["weight_sync"] = {"dtype": config.weight_sync.dtype, "reason": FOLLOWS}
    else:
        note("weight_sync", config.weight_sync.dtype, None, "weight_sync.dtype")
    if "judge" in roles:
        judge = config.grader.judge
        if judge.dtype == "auto":
            judge.dtype = choices["judge"].dtype
        note("judge", judge.dtype, choices.get("judge"), "grader.judge.dtype")
    for role in ("trainer", "reference"):
        if role not in roles:
            continue
        section = getattr(config, role)
        if section.bf16_autocast:
            section.bf16_autocast = choices[role].bf16
        note(role, "bf16 autocast" if section.bf16_autocast else "float32", choices.get(role),
             f"{role}.bf16_autocast false")
    if g.exact:  # the trainer's numerics: its float32 master weights published, its autocast rule
        config.weight_sync.dtype = "float32"
        g.dtype = "bfloat16" if config.trainer.bf16_autocast else "float32"
        chosen["generator"] = {"dtype": f"float32 weights, {'bf16 autocast' if g.dtype == 'bfloat16' else 'float32'}",
                               "reason": "generator.exact: the trainer's numerics"}
        chosen["weight_sync"] = {"dtype": "float32", "reason": "generator.exact: the trainer's master weights"}
    return Dtypes(chosen)
