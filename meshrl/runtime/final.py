"""What a run leaves in final/, and which policy that is (summary.json's `final_policy`, the run's last line).

The trainer writes final/ when it holds the last version trained: the usual end, and a stop between steps.
It does not hold it when the run ends while a trainer restart brings it back (restored, training its logged
batches again: meshrl/restarts.py), after it applied part of a step's updates, or when it died or does not
answer. final/ then comes from the newest of what does hold a trained version:

    the trainer, at the last version trained ──────────────────────────────► final/ (the usual end)
    else, newest first:  a generator replica's copy of the version it serves (`save_policy`)
                         the newest checkpoint, restored into the trainer (if it answers)   ──► final/
    else ─────────────────────────────────────────────────────────────────► nothing written, said why

Ties go to the generator (it needs no other role). final/ is written whole or not at all: under another name,
then renamed over the one before.
"""

import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from meshrl.actors.replicas import error_line
from meshrl.checkpoint import checkpoints

logger = logging.getLogger(__name__)


@dataclass
class FinalPolicy:
    version: int  # the policy version final/ holds
    source: str  # "the trainer", "generator 1", "checkpoint step-4"
    why: str = ""  # why not the trainer's, when it is not

    def describe(self) -> str:
        """What final/ holds, for the run's last line: "policy version 3 (final/, from generator 0: ...)"."""
        return f"policy version {self.version} (final/, from {self.source}" + (f": {self.why})" if self.why else ")")

    def summary(self) -> dict:
        return asdict(self)


def trainer_behind(controller) -> str | None:
    """Why the trainer's weights are not the last version trained, or None when they are."""
    if controller is None:
        return None
    if controller.restarts.trainer_behind:
        return "the trainer was being brought back after a restart when the run stopped"
    if controller.restarts.given_up == "trainer":  # dead or hung: asking it would wait out its timeout
        return "the trainer failed more often in a row than trainer.max_restarts allows"
    if controller.training and controller.training["updates"]:
        return (f"the trainer had applied {controller.training['updates']} of step {controller.rows.done + 1}'s "
                "updates when the run stopped")
    return None


async def save_final(run_dir: Path, trainer, controller, generators, tracer, timeouts,
                     why: str | None = None) -> FinalPolicy | None:
    """Write final/ as the module says; what it holds, or None (one log line) when nothing could be written.
    `why`: a reason known already not to ask the trainer (it did not answer its last call)."""
    final, partial = Path(run_dir) / "final", Path(run_dir) / ".final.partial"
    shutil.rmtree(partial, ignore_errors=True)
    why = why or trainer_behind(controller)
    if why is None:
        version = controller.trainer_version if controller else 0
        try:
            async with tracer.span("trainer", "save", version, timeout=timeouts.trainer):
                await trainer.save.call(str(partial))
            return _placed(partial, final, FinalPolicy(version, "the trainer"))
        except Exception as e:  # dead or hung: what else holds a trained version is asked below
            why = f"the trainer could not write it ({error_line(e)})"
    for _, source, write in await _candidates(run_dir, controller, generators):
        try:  # the version written, as the writer says (a replica answers for the version it saved)
            if (version := await write(str(partial))) is not None:
                return _placed(partial, final, FinalPolicy(version, source, why))
        except Exception as e:  # that one cannot: the next
            logger.warning("final/ could not be written from %s: %s", source, error_line(e))
        shutil.rmtree(partial, ignore_errors=True)
    logger.error("the policy was not saved (final/): %s, and no generator or checkpoint holds a trained version", why)
    return None


async def _candidates(run_dir: Path, controller, generators) -> list[tuple[int, str, object]]:
    """(version, source, write(path)) of each generator's served copy and of the newest checkpoint, newest
    first (a generator before a checkpoint of the same version)."""
    found = []
    for replica in generators.replicas if generators else []:
        if not replica.healthy:
            continue
        try:
            version = await replica.actor.served_copy.call_one()
        except Exception as e:  # a replica that cannot answer holds nothing we can use
            logger.warning("generator %d could not say what it serves: %s", replica.index, error_line(e))
            continue
        if version is not None:
            found.append((version, 1, f"generator {replica.index}", replica.actor.save_policy.call_one))
    saved = checkpoints(run_dir)
    if saved and controller is not None:
        step, path = saved[-1]

        async def from_checkpoint(out: str, path=path):
            version = await controller.checkpointer.restore_trainer(path)
            await controller.trainer.save.call(out)
            return version

        found.append((step, 0, f"checkpoint {path.name}", from_checkpoint))
    return [(version, source, write) for version, _, source, write in sorted(found, reverse=True, key=lambda f: f[:2])]


def _placed(partial: Path, final: Path, policy: FinalPolicy) -> FinalPolicy:
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return policy
