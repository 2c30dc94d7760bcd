"""Every `auto` of a run's config settled once, at the start, before any role is spawned, and written whole to
RUN_DIR/resolved.json beside config.json (what the run was asked for). The roles are started with these values
and settle nothing themselves (tests/test_settled.py: outside a config's checks and the rules below, no code
compares a setting with "auto").

    config.json ─► resolve (meshrl.configs: derived lengths and schedules, weight_update, generate_ahead, ...)
                ─► the GPU plan (meshrl/runtime/gpu_plan.py: devices, memory fractions, sleep, ring memory)
                ─► the dtypes, measured on each role's host (meshrl/runtime/dtypes.py)
                ─► `settle` (here: each `auto` left, by the rule that owns it) ─► resolved.json ─► every role
(`logging.wandb_mode` is settled with resolve, in meshrl/runtime/run.py: the loggers start before the hosts.)

Each rule stays with its subject (the memory switches in meshrl/models/memory.py, the ring's memory and
staging in meshrl/weight_sync/, ...); this module only asks each once, with what the run knows at the start.
One `auto` may stay: `weight_sync.transport` where the trainer and the generators run on hosts of their own
(a job other than local or process): each reader takes shared memory for a ring on its own host and RDMA
otherwise, and placement.json names what each replica took.
"""

import copy
import json
from pathlib import Path

import torch

from meshrl.actors.adapters import serves_adapters
from meshrl.configs import Config, to_dict
from meshrl.losses import bf16_compute
from meshrl.models.memory import resolve as memory_switches
from meshrl.models.model import chat_template
from meshrl.runtime.jobs import RolePlacement
from meshrl.runtime.relays import relays_on
from meshrl.tasks.tool_calls import parser_name
from meshrl.weight_sync.device_ring import ring_memory
from meshrl.weight_sync.staging import resolve_staging

ONE_MACHINE = ("local", "process")  # job kinds whose every process runs on this machine
UNUSED = "unused"  # a setting of a part this run does not start (the judge's dtype without a judge)


def settle(config: Config, placement: dict[str, RolePlacement], model_path: Path, hf_config: dict,
           run_dir: Path, judged: bool, shared: bool) -> Config:
    """A copy of `config` (resolved, with the GPU plan and the dtypes written in) with every `auto` left settled
    as the module says; `judged`: the graders serve a judge model; `shared`: the GPU plan has roles share GPUs."""
    config = copy.deepcopy(config)
    m, g, t, r, w = config.model, config.generator, config.trainer, config.reference, config.weight_sync
    for section in (t, r):  # the GPU plan gave them none: no GPU on their hosts
        if section.device == "auto":
            section.device = "cpu"
    trainer_device = t.device.split(";")[0]
    on_gpu = bool(g.devices)  # the GPU plan's, or the user's
    if m.chat_template == "auto":  # the checkpoint's own, kept beside the run's config
        (run_dir / "chat_template.jinja").write_text(chat_template(model_path, "auto"))
        m.chat_template = str((run_dir / "chat_template.jinja").absolute())
    m.tool_parser = parser_name(m.tool_parser, hf_config)
    for name in ("cuda_graphs", "sleep"):  # vLLM's: on a GPU, graphs on and sleep as the plan said; off elsewhere
        if getattr(g.engine, name) == "auto":
            setattr(g.engine, name, "on" if on_gpu and name == "cuda_graphs" else "off")
    if not judged:
        config.grader.judge.dtype = UNUSED
    t.lora.serving = "adapter" if serves_adapters(t.lora, on_gpu) else "merged"
    for section in (t, r):
        device = section.device.split(";")[0]
        switches = memory_switches(device.split(":")[0], bf16_compute(torch.device(device), section.bf16_autocast),
                                   getattr(section, "activation_checkpointing", "off"),
                                   getattr(section, "bf16_all_gather", "off"), getattr(section, "dtype", "float32"))
        if section is t:
            t.activation_checkpointing = switches.activation_checkpointing
            t.bf16_all_gather = "on" if switches.all_gather_dtype == "bfloat16" else "off"
        else:
            r.dtype = switches.reference_dtype
    generators, trainer = placement["generator"], placement["trainer"]
    w.relay = "on" if relays_on(config, placement) else "off"
    w.memory = ring_memory(w.memory, trainer_device.startswith("cuda"), trainer.hosts,
                           generators.group == trainer.group, w.relay, bool(t.lora.rank))
    w.staging = resolve_staging(w.staging, trainer_device)
    if w.transport == "auto" and config.job.kind in ONE_MACHINE:
        w.transport = "shm"
    if config.job.gpu_sharing == "auto":  # as the plan did: off plans the same where nothing is shared
        config.job.gpu_sharing = "on" if shared else "off"
    return config


def write(config: Config, run_dir: Path) -> None:
    """resolved.json: the settled config, as every role was started with it."""
    (run_dir / "resolved.json").write_text(json.dumps(to_dict(config), indent=2))


def unsettled(settled: dict, prefix: str = "") -> list[str]:
    """The dotted names of the settings still `auto` in a resolved.json's dict."""
    found = []
    for key, value in settled.items():
        if isinstance(value, dict):
            found += unsettled(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found
