"""Where each step's metrics go: `metrics.jsonl` (the source of truth), TensorBoard event files in
the run directory (on by default), and Weights & Biases (opt-in). (The trained completions go to
`rollouts.jsonl` from the replay buffer, which holds their text: meshrl/episodes.py's RolloutRecorder.)

Every logger gets the same keys at the same step. A list value (one number per optimizer update,
such as `clip_fraction_by_update`) stays a list in metrics.jsonl and becomes `key/0`, `key/1`, ...
in the dashboards. W&B never blocks a run: without an API key or a reachable server it logs offline
into the run directory (`wandb sync` uploads it later).
"""

import json
import logging
import math
import netrc
import os
import socket
from pathlib import Path

from meshrl.configs import LoggingConfig, to_dict

logger = logging.getLogger(__name__)


def scalars(row: dict) -> dict[str, float]:
    """The numbers of a metrics row as dashboard scalars (lists flattened to `key/i`)."""
    out = {}
    for key, value in row.items():
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{key}/{i}" if isinstance(value, list) else key] = float(v)
    return out


def wandb_mode(config: LoggingConfig) -> str:
    """"online" only with an API key and a server that answers within 2 s, else "offline"."""
    if config.wandb_mode != "auto":
        return config.wandb_mode
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0].split(":")[0]
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has(host)):
        return "offline"
    try:
        socket.create_connection((host, 443), timeout=2).close()
        return "online"
    except OSError:
        return "offline"


def _netrc_has(host: str) -> bool:
    """Whether `wandb login` stored a key for `host` (in ~/.netrc)."""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MetricLoggers:
    """Writes one metrics row per step to every configured sink."""

    def __init__(self, run_dir: Path, config, name: str, resumed_rows: list[dict] = ()):
        """`resumed_rows`: the metrics of a resumed run's checkpoint: metrics.jsonl is rewritten with
        them (rows logged after the checkpoint are dropped: those steps run again) and TensorBoard
        drops its events from later steps."""
        self.file = open(run_dir / "metrics.jsonl", "w")
        self.file.writelines(json.dumps(row) + "\n" for row in resumed_rows)
        self.tensorboard = self.wandb = None
        if config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resumed_rows[-1]["step"] + 1 if resumed_rows else None
            self.tensorboard = SummaryWriter(log_dir=str(run_dir), purge_step=purge)
        if config.logging.wandb:
            self.wandb = self._start_wandb(run_dir, config, name)

    @staticmethod
    def _start_wandb(run_dir: Path, config, name: str):
        import wandb

        mode = wandb_mode(config.logging)
        try:
            return wandb.init(project=config.logging.wandb_project, name=config.logging.wandb_run_name or name,
                              dir=str(run_dir), config=to_dict(config), mode=mode,
                              settings=wandb.Settings(init_timeout=30, console="off", silent=True))
        except Exception as e:  # the service failed to start or answer: keep training, say so once
            logger.warning("W&B %s logging failed to start (%s); metrics.jsonl and TensorBoard continue", mode, e)
            return None

    def log(self, row: dict) -> None:
        step = row["step"]
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in scalars(row).items() if k != "step" and not math.isnan(v)}
        if self.tensorboard:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
