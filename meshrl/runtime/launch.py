"""Starting a run's actors, all before a step runs: each role's implementation checked against its
contract, its proc mesh spawned on the hosts its config names. The config they are given is resolved
(meshrl.configs.resolve, then the GPU plan and the dtypes: meshrl/runtime/gpu_plan.py, dtypes.py): this
module derives nothing from it but each replica's own cores, GPUs and seed."""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshrl.actors import load_actor_class, placement, spawn, spawn_ranks
from meshrl.actors.generator_config import generator_impl
from meshrl.actors.replay_buffer import buffer_impl
from meshrl.actors.roles import ROLES, missing_endpoints
from meshrl.configs import Config
from meshrl.runtime.jobs import Hosts
from meshrl.tasks import is_environment, is_session, task_class

if TYPE_CHECKING:
    from monarch._src.actor.actor_mesh import ActorMesh

    from meshrl.actors import roles

logger = logging.getLogger(__name__)


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
    roles = {"grader": config.grader, "trainer": config.trainer}
    base_reference = config.trainer.loss.kl_coef > 0 and config.trainer.lora.rank > 0  # the trainer's own base
    if config.trainer.loss.kl_coef > 0 and not base_reference:
        roles["reference"] = config.reference
    classes = {role: load_actor_class(role_config.impl) for role, role_config in roles.items()}
    roles["generator"], classes["generator"] = config.generator, load_actor_class(generator_impl(config.generator.impl))
    roles["replay_buffer"] = config.replay_buffer
    classes["replay_buffer"] = load_actor_class(buffer_impl(config.replay_buffer.impl))
    multi_turn = is_environment(task_class(config.task))
    if multi_turn and config.generator.exact:
        raise ValueError("generator.exact re-scores each completion as the trainer scores its sequence: a multi-turn "
                         "conversation is trained as one sequence, which no turn's re-scoring sees whole: single-turn "
                         "tasks only")
    if multi_turn and config.generator.request_seeds:
        raise ValueError("generator.request_seeds is for single-turn tasks: a multi-turn group's conversations are "
                         "requests of one sample each with the same opening, and seeded alike they would all "
                         "sample the same turns")
    for role, cls in classes.items():
        if missing := missing_endpoints(role, cls, multi_turn, base_reference, is_session(task_class(config.task))):
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
    """Replica `index`'s constructor arguments: its own cores ("0;1": one set per replica), GPUs and seed,
    and with LoRA the trainer's `trainer.lora` (what the trainer publishes is an adapter).
    With request seeds every replica has the run's seed, which each request's seed is made from: a group
    samples the same completions whichever replica serves it (and however many there are, after a resume)."""
    g = config.generator
    replica = dataclasses.replace(g, cpus=placement(g.cpus, index), devices=placement(g.devices, index),
                                  seed=g.seed + (0 if g.request_seeds else index))
    lora = (config.trainer.lora,) if config.trainer.lora.rank else ()  # serve the trainer's adapter on the base
    return replica, config.weight_sync, str(checkpoint), *lora


def note_fault(failure) -> None:
    """Monarch's hook for a dead actor process that no one supervises: its default exits the whole
    program. Here the failed calls raise instead, and the pools replace replicas."""
    logger.debug("actor failure: %s", failure)
