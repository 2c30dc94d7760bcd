"""`meshrl eval RUN_DIR [--split test]`: a finished run's policy (its final/, or any HF checkpoint or LoRA
adapter) scored on one of its task's held-out splits with the run's own settings, through the same
generators, graders and rates as the eval during training. The eval during training uses validation,
which chooses settings; test is for the figures reported once they are chosen.

It runs in a directory of its own (RUN_DIR/eval-SPLIT, or RUN_DIR/eval-SPLIT-NAME for `--policy
.../NAME`: its config, trace and `eval.json`), so the training run's files are left as they were.
"""

import asyncio
import json
import sys
from pathlib import Path

from meshrl.configs import from_saved
from meshrl.tasks.splits import check_split


def eval_run(run_dir: Path, split: str = "test", policy: Path | None = None):
    """The Run that evaluates `run_dir`'s policy (or `policy`) on `split`; ValueError for a bad input."""
    from meshrl.models.model import merge_adapter
    from meshrl.runtime.run import Run

    check_split(split)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    out = run_dir / (f"eval-{split}" if policy is None else f"eval-{split}-{policy.name}")
    policy = policy or run_dir / "final"
    if not policy.is_dir():
        raise ValueError(f"{policy} not found: the run has not saved a policy yet (--policy names another)")
    config = from_saved(json.loads((run_dir / "config.json").read_text()))
    if (policy / "adapter_config.json").is_file():  # a LoRA run's adapter: its base with it merged in
        merged = out / "merged"
        if not (merged / "config.json").is_file():
            merge_adapter(policy, merged)
        policy, config.trainer.lora.rank = merged, 0
    config.model.source = str(policy.absolute())
    config.job.kind = "local" if config.job.kind != "workers" else config.job.kind
    config.checkpoint.every, config.weight_sync.verify = 0, False
    return Run(config, out)


def evaluate(run, split: str) -> dict:
    """Score `run` on `split`; the rates, also written to its eval.json with what was scored."""
    rates = asyncio.run(run.evaluate(split))
    result = {"split": split, "policy": run.config.model.source, "prompts": len(run.task.eval_samples(split)),
              "samples_per_prompt": run.config.controller.eval_samples,
              "temperature": run.config.controller.eval_temperature, "rates": rates}
    (run.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def table(result: dict) -> str:
    """The rates as a two-column Markdown table, headed by what was scored."""
    head = (f"{result['split']} split: {result['prompts']} prompts x {result['samples_per_prompt']} "
            f"(temperature {result['temperature']:g}), policy {result['policy']}")
    rows = [f"| {key.removeprefix('eval_')} | {value:.3f} |" for key, value in result["rates"].items()]
    return "\n".join([head, "", "| rate | value |", "| --- | --- |", *rows])


def eval_command(run_dir: Path, split: str, policy: Path | None) -> int:
    """`meshrl eval`: the table, then the same as one JSON line; one `meshrl: error:` line if it fails."""
    from meshrl.actors.replicas import RoleFailed

    run = eval_run(run_dir, split, policy)  # bad input: ValueError, one line from the CLI
    try:
        result = evaluate(run, split)
    except RoleFailed as e:
        print(f"meshrl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"meshrl: eval of {run_dir} stopped", file=sys.stderr)
        return 130
    print(table(result))
    print(json.dumps(result))
    return 0
