"""Starting a run's actors: each role's implementation checked against its contract, its proc mesh
spawned on the hosts its config names, and the config's cross-field checks, all before a step runs."""

import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from meshrl.actors import load_actor_class, placement, spawn, spawn_ranks
from meshrl.actors.roles import ROLES, missing_endpoints
from meshrl.advantages import STEP_WISE, estimator
from meshrl.configs import Config
from meshrl.jobs import Hosts
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
    if config.logging.wandb_mode not in ("auto", "online", "offline"):
        raise ValueError(f"unknown logging.wandb_mode {config.logging.wandb_mode!r}; known: auto, online, offline")
    if config.replay_buffer.max_policy_age < 0:
        raise ValueError("replay_buffer.max_policy_age must be at least 0")
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


@dataclass
class Actors:
    """Handles to the single actors' meshes (the generators and graders are pools of replicas, whose
    actors follow roles.Generator and roles.Grader); meshrl/actors/roles.py says what each must answer."""

    trainer: "ActorMesh[roles.Trainer]"
    replay_buffer: "ActorMesh[roles.ReplayBuffer]"
    procs: list  # the proc meshes, to stop
    reference: "ActorMesh[roles.Reference] | None" = None


def actor_classes(config: Config) -> dict[str, type]:
    """The implementation each role's config names (checked before anything starts)."""
    roles = {"generator": config.generator, "grader": config.grader, "trainer": config.trainer,
             "replay_buffer": config.replay_buffer}
    if config.trainer.loss.kl_coef > 0:
        roles["reference"] = config.reference
    classes = {role: load_actor_class(role_config.impl) for role, role_config in roles.items()}
    multi_turn = is_environment(task_class(config.task))
    for role, cls in classes.items():
        if missing := missing_endpoints(role, cls, multi_turn):
            raise ValueError(f"{roles[role].impl} cannot be the {role}: it has no {', '.join(missing)} endpoint "
                             f"(the contract is meshrl.actors.roles.{ROLES[role].__name__})")
    return classes


async def spawn_actors(config: Config, classes: dict[str, type], checkpoint: Path, hosts: Hosts) -> Actors:
    """One proc mesh per role besides the pools, on the hosts each role's config names: the trainer's
    (`trainer.ranks` processes), the replay buffer's and the reference's (`reference.ranks`)."""
    procs, trainer = await spawn_ranks("trainer", classes["trainer"], config.trainer.ranks, config.trainer,
                                       config.weight_sync, str(checkpoint), hosts=hosts.of("trainer"))
    actors, meshes = {"trainer": trainer}, [procs]
    procs, actors["replay_buffer"] = spawn("replay_buffer", classes["replay_buffer"], config.replay_buffer,
                                           host=hosts.host("replay_buffer", 0))
    meshes.append(procs)
    if "reference" in classes:
        procs, actors["reference"] = await spawn_ranks("reference", classes["reference"], config.reference.ranks,
                                                       config.reference, str(checkpoint),
                                                       hosts=hosts.of("reference"))
        meshes.append(procs)
    return Actors(**actors, procs=meshes)


def generator_args(config: Config, index: int, checkpoint: Path) -> tuple:
    """Replica `index`'s constructor arguments: its own cores ("0;1": one set per replica) and seed."""
    replica = dataclasses.replace(config.generator, cpus=placement(config.generator.cpus, index),
                                  seed=config.generator.seed + index)
    return replica, config.weight_sync, str(checkpoint)


def note_fault(failure) -> None:
    """Monarch's hook for a dead actor process that no one supervises: its default exits the whole
    program. Here the failed calls raise instead, and the pools replace replicas."""
    logger.debug("actor failure: %s", failure)


class StopSignals:
    """Ctrl-C (SIGINT) or SIGTERM cancels the training task while it is `cancellable`; the controller
    then writes a checkpoint, saves the policy and writes what it has. `stopped_by` names the signal.

    Installed once the actors run: Monarch's runtime replaces the process's SIGINT handler beneath
    Python's, so asyncio's own Ctrl-C handling never fires. While a step trains (`hold`) a stop waits
    for it to end, so that the checkpoint has whole steps; a second signal stops at once."""

    def __init__(self):
        self.stopped_by: str | None = None
        self.cancellable = False
        self.held = False  # a step is training (the controller's hold): a stop waits for it
        self.task: asyncio.Task | None = None

    def install(self) -> None:
        loop, self.task = asyncio.get_running_loop(), asyncio.current_task()

        def stop(sig: signal.Signals) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig.name
                tqdm.write(f"{sig.name}: stopping after this step; saving a checkpoint and the policy "
                           f"(again to stop at once)")
                if self.cancellable and not self.held:
                    self.task.cancel()
            elif self.cancellable:  # the second: at once, without waiting for the step
                self.task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)

    def hold(self) -> None:
        """A stop asked for from now on waits for `release_hold`."""
        self.held = True

    def release_hold(self) -> None:
        self.held = False
        if self.stopped_by and self.cancellable:
            self.task.cancel()  # the stop asked for while held

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
