"""Starting a run's actors: each role's implementation checked against its contract, its proc mesh
spawned on the hosts its config names, and the config's cross-field checks, all before a step runs;
the dtype weights are published in."""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from monarch.actor import Actor, endpoint

from meshrl.actors import load_actor_class, placement, spawn, spawn_ranks
from meshrl.actors.replay_buffer import buffer_impl
from meshrl.actors.roles import ROLES, missing_endpoints
from meshrl.advantages import STEP_WISE, estimator
from meshrl.configs import Config
from meshrl.runtime.jobs import Hosts
from meshrl.losses import check as check_loss
from meshrl.tasks import is_environment, task_class

if TYPE_CHECKING:
    from monarch._src.actor.actor_mesh import ActorMesh

    from meshrl.actors import roles

logger = logging.getLogger(__name__)


def check_config(config: Config) -> None:
    """ValueError (one line) for values that cannot work together, before anything starts."""
    cfg = config.controller
    if cfg.steps < 1 or cfg.prompts_per_step < 1 or cfg.eval_samples < 1:
        raise ValueError("controller.steps, prompts_per_step and eval_samples must be at least 1")
    if cfg.group_size < 2:
        raise ValueError("controller.group_size must be at least 2: a group of one has no advantage to learn from")
    if config.trainer.mini_batches < 1 or config.trainer.micro_batch_size < 1:
        raise ValueError("trainer.mini_batches and trainer.micro_batch_size must be at least 1")
    if config.trainer.micro_batch_tokens < 0:
        raise ValueError("trainer.micro_batch_tokens must be 0 (micro_batch_size sequences each) or more")
    if config.logging.wandb_mode not in ("auto", "online", "offline"):
        raise ValueError(f"unknown logging.wandb_mode {config.logging.wandb_mode!r}; known: auto, online, offline")
    if cfg.max_policy_age < 0:
        raise ValueError("controller.max_policy_age must be at least 0")
    if min(config.generator.max_restarts, config.grader.max_restarts, config.trainer.max_restarts,
           config.reference.max_restarts, config.replay_buffer.max_restarts, cfg.restart_window_s) < 0:
        raise ValueError("generator.max_restarts, grader.max_restarts, trainer.max_restarts, reference.max_restarts, "
                         "replay_buffer.max_restarts and controller.restart_window_s must be at least 0")
    if cfg.generate_ahead > cfg.max_policy_age:
        raise ValueError(f"controller.generate_ahead ({cfg.generate_ahead}) cannot be more than "
                         f"controller.max_policy_age ({cfg.max_policy_age}): its groups would be stale when trained")
    if not 0 <= cfg.max_failed_fraction <= 1:
        raise ValueError("controller.max_failed_fraction must be between 0 and 1")
    if config.generator.top_p != 1:
        raise ValueError(f"generator.top_p {config.generator.top_p:g}: training samples must come from the whole "
                         "distribution at generator.temperature, which the trainer's logprobs follow; keep it 1 "
                         "(controller.eval_top_p sets eval's)")
    if config.generator.weight_update not in ("auto", "drain", "in_flight", "recompute"):
        raise ValueError(f"unknown generator.weight_update {config.generator.weight_update!r}; known: auto, drain, "
                         "in_flight, recompute")
    if cfg.staleness not in ("oldest_token", "newest_token"):
        raise ValueError(f"unknown controller.staleness {cfg.staleness!r}; known: oldest_token, newest_token")
    if config.weight_sync.transport not in ("auto", "shm", "rdma", "disk"):
        raise ValueError(f"unknown weight_sync.transport {config.weight_sync.transport!r}; known: auto, shm, rdma, disk")
    if config.weight_sync.transport == "disk" and config.weight_sync.verify:
        raise ValueError("weight_sync.verify checks the ring's loads against the disk path: it needs a ring "
                         "(weight_sync.transport auto, shm or rdma)")
    if config.weight_sync.verify and config.generator.tensor_parallel_size > 1:
        raise ValueError("weight_sync.verify compares the tensors of a generator's own vLLM worker: it needs "
                         "generator.tensor_parallel_size 1")
    if config.weight_sync.dtype not in ("auto", "bfloat16", "float32", "float16"):
        raise ValueError(f"unknown weight_sync.dtype {config.weight_sync.dtype!r}; known: auto, bfloat16, float32, float16")
    if min(config.generator.replicas, config.grader.replicas, config.trainer.ranks, config.reference.ranks) < 1:
        raise ValueError("generator.replicas, grader.replicas, trainer.ranks and reference.ranks must be at least 1")
    if ";" in config.generator.cpus and len(config.generator.cpus.split(";")) != config.generator.replicas:
        raise ValueError(f"generator.cpus {config.generator.cpus!r} names one set of cores per replica: "
                         f"it needs {config.generator.replicas} sets separated by ';'")
    if config.generator.temperature == 0 or (cfg.eval_samples > 1 and cfg.eval_temperature == 0):
        raise ValueError("greedy sampling gives one answer per prompt: generator.temperature must be above 0, "
                         "and so must controller.eval_temperature when eval_samples is above 1")
    if cfg.max_turns < 1:
        raise ValueError("controller.max_turns must be at least 1")
    estimator(cfg.advantage.removeprefix(STEP_WISE))
    check_loss(config.trainer.loss)
    if not 0 <= config.grader.judge.rule_weight <= 1:
        raise ValueError(f"grader.judge.rule_weight must be in [0, 1], not {config.grader.judge.rule_weight:g}")
    buffer = config.replay_buffer
    if buffer.impl == "replay":
        if cfg.max_policy_age < 1:
            raise ValueError("replay_buffer.impl replay trains groups again in later steps, which the staleness bound "
                             "must allow: set controller.max_policy_age to 1 or more")
        if not 0 < buffer.fresh_fraction <= 1 or buffer.max_reuse < 1:
            raise ValueError("replay_buffer.fresh_fraction must be in (0, 1] and replay_buffer.max_reuse at least 1")
        if buffer.priority not in ("reward_std", "newest"):
            raise ValueError(f"unknown replay_buffer.priority {buffer.priority!r}; known: reward_std, newest")
    if config.grader.judge.rubric:
        from meshrl.actors.judge import check_rubric

        check_rubric(config.grader.judge.rubric)


@dataclass
class Actors:
    """Handles to the single actors' meshes (the generators and graders are pools of replicas, whose
    actors follow roles.Generator and roles.Grader); meshrl/actors/roles.py says what each must answer."""

    trainer: "ActorMesh[roles.Trainer]"
    buffer: "ActorMesh[roles.ReplayBuffer]"
    procs: dict  # role -> its proc mesh, to stop
    reference: "ActorMesh[roles.Reference] | None" = None


def actor_classes(config: Config) -> dict[str, type]:
    """The implementation each role's config names (checked before anything starts)."""
    roles = {"generator": config.generator, "grader": config.grader, "trainer": config.trainer}
    if config.trainer.loss.kl_coef > 0:
        roles["reference"] = config.reference
    classes = {role: load_actor_class(role_config.impl) for role, role_config in roles.items()}
    roles["replay_buffer"] = config.replay_buffer
    classes["replay_buffer"] = load_actor_class(buffer_impl(config.replay_buffer.impl))
    multi_turn = is_environment(task_class(config.task))
    if multi_turn and config.generator.request_seeds:
        raise ValueError("generator.request_seeds is for single-turn tasks: a multi-turn group's conversations are "
                         "requests of one sample each with the same opening, and seeded alike they would all "
                         "sample the same turns")
    for role, cls in classes.items():
        if missing := missing_endpoints(role, cls, multi_turn):
            raise ValueError(f"{roles[role].impl} cannot be the {role}: it has no {', '.join(missing)} endpoint "
                             f"(the contract is meshrl.actors.roles.{ROLES[role].__name__})")
    return classes


async def spawn_actors(config: Config, classes: dict[str, type], checkpoint: Path, hosts: Hosts,
                       pad_id: int) -> Actors:
    """One proc mesh per role besides the pools, on the hosts each role's config names: the trainer's
    (`trainer.ranks` processes), the reference's (`reference.ranks`) and the replay buffer's (one,
    which the others take their micro-batches from)."""
    actors, meshes = {}, {}
    for role in ("trainer", "reference"):
        if role in classes:
            meshes[role], actors[role] = await spawn_ranked(role, config, classes, checkpoint, hosts)
    meshes["replay_buffer"], buffer = spawn_buffer(config, classes, hosts, pad_id)
    for role in ("trainer", "reference"):
        if role in actors:
            await actors[role].attach_buffer.call(buffer)
    return Actors(**actors, buffer=buffer, procs=meshes)


async def spawn_ranked(role: str, config: Config, classes: dict[str, type], checkpoint: Path, hosts: Hosts):
    """The trainer's or the reference's proc mesh and actor mesh (`ranks` processes on its hosts), at the
    start or in a dead one's place."""
    if role == "trainer":
        args = (config.trainer, config.weight_sync, str(checkpoint))
    else:
        args = (config.reference, str(checkpoint))
    return await spawn_ranks(role, classes[role], args[0].ranks, *args, hosts=hosts.of(role))


def spawn_buffer(config: Config, classes: dict[str, type], hosts: Hosts, pad_id: int):
    """The replay buffer's proc mesh and actor (one process), at the start or in a dead one's place."""
    return spawn("replay_buffer", classes["replay_buffer"], config.replay_buffer, config.trainer,
                 config.controller.prompts_per_step, config.controller.max_policy_age, pad_id,
                 host=hosts.host("replay_buffer", 0))


def generator_args(config: Config, index: int, checkpoint: Path) -> tuple:
    """Replica `index`'s constructor arguments: its own cores ("0;1": one set per replica), GPUs and seed.
    With request seeds every replica has the run's seed, which each request's seed is made from: a group
    samples the same completions whichever replica serves it (and however many there are, after a resume)."""
    g = config.generator
    replica = dataclasses.replace(g, cpus=placement(g.cpus, index), devices=placement(g.devices, index),
                                  seed=g.seed + (0 if g.request_seeds else index), weight_update=weight_update(config))
    return replica, config.weight_sync, str(checkpoint)


def weight_update(config: Config) -> str:
    """`generator.weight_update`, `auto` resolved: drain when training is synchronous (max_policy_age 0:
    nothing may span two versions), else in flight."""
    update = config.generator.weight_update
    if update == "auto":
        return "drain" if config.controller.max_policy_age == 0 else "in_flight"
    return update


def note_fault(failure) -> None:
    """Monarch's hook for a dead actor process that no one supervises: its default exits the whole
    program. Here the failed calls raise instead, and the pools replace replicas."""
    logger.debug("actor failure: %s", failure)


class DtypeProbe(Actor):
    """Asked on a generator's host which dtype vLLM serves there (its hardware decides `auto`)."""

    @endpoint
    async def served(self, dtype: str) -> str:
        from meshrl.actors.engine import vllm_dtype

        return vllm_dtype(dtype)


VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other names for them


async def weight_dtype(config: Config, hosts: Hosts, local: bool) -> str:
    """The dtype versions are published in: `weight_sync.dtype`, or for `auto` the one the generators
    serve (vLLM's on generator 0's host, asked there unless it is this one, `local`), so that the served
    policy is exactly the trained one, not a rounded copy."""
    if config.weight_sync.dtype != "auto":
        return config.weight_sync.dtype
    if local:
        from meshrl.actors.engine import vllm_dtype

        served = vllm_dtype(config.generator.dtype)
    else:
        procs, probe = spawn("dtype_probe", DtypeProbe, host=hosts.host("generator", 0))
        try:
            served = await probe.served.call_one(config.generator.dtype)
        finally:
            await procs.stop()
    return VLLM_DTYPES.get(served, served)
