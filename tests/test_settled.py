"""Every `auto` settled once, before anything spawns (meshrl/runtime/settle.py), into resolved.json: no code
but the config passes and the rules they ask compares a setting with "auto" (a rule planted in an actor is
found), and the settled config of a run on this machine holds no `auto`."""

import ast
import json
from pathlib import Path

import meshrl
from meshrl.actors.dtypes import Bf16Choice
from meshrl.configs import resolve, to_dict
from meshrl.configs.named import load_config
from meshrl.models.model import chat_template, read_hf_config, resolve_checkpoint
from meshrl.runtime.dtypes import apply as apply_dtypes
from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import plan
from meshrl.runtime.loggers import wandb_mode
from meshrl.runtime.settle import UNUSED, settle, unsettled

ROOT = Path(meshrl.__file__).parent
# Where "auto" may be read: the passes that settle a run's config before anything spawns ...
PASSES = {"configs/__init__.py": {"resolve"}, "runtime/settle.py": None, "runtime/dtypes.py": None,
          "runtime/gpu_plan.py": None, "runtime/memory_plan.py": None}
# ... and the rules they ask, each with its subject (an actor calling one gets a settled value back)
RULES = {"actors/__init__.py": {"resolve_device"}, "actors/adapters.py": {"serves_adapters"},
         "actors/engine.py": {"vllm_dtype"}, "models/memory.py": {"resolve"},
         "models/model.py": {"chat_template", "__init__"},  # ChatTokenizer's name for the template it took
         "runtime/loggers.py": {"wandb_mode"}, "tasks/tool_calls.py": {"parser_name"},
         "weight_sync/__init__.py": {"published_weights"}, "weight_sync/device_ring.py": {"ring_memory"},
         "weight_sync/staging.py": {"resolve_staging"},
         "weight_sync/ring.py": {"choose_transport"}}  # per reader, where the run could not settle it (settle.py)


def reads_of_auto(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of every comparison with "auto" in `source`, and every call handing a
    function the literal "auto", outside a config's `check`."""
    found = []

    def is_auto(node) -> bool:
        return (isinstance(node, ast.Constant) and node.value == "auto") or (
            isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_auto(e) for e in node.elts))

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if inner == "check":
                continue
            if isinstance(child, ast.Compare) and any(is_auto(n) for n in [child.left, *child.comparators]):
                found.append((child.lineno, inner))
            if isinstance(child, ast.Call) and any(is_auto(a) for a in child.args):
                found.append((child.lineno, inner))
            walk(child, inner)

    walk(ast.parse(source), None)
    return found


def settling_outside_the_passes(root: Path, sources: dict[str, str] | None = None) -> list[str]:
    """"path:line (function)" of each read of "auto" in the package that neither a pass nor a rule makes;
    `sources` replaces files' text (a planted rule)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root))
        if name.startswith("tools/"):  # the benches and checks set up their own stand-ins, outside any run
            continue
        allowed = {**RULES, **PASSES}.get(name, set())
        source = (sources or {}).get(name) or path.read_text()
        found += [f"{name}:{line} ({function})" for line, function in reads_of_auto(source)
                  if allowed is not None and function not in allowed]
    return found


def test_no_role_settles_an_auto_only_the_passes_and_their_rules_read_one():
    assert settling_outside_the_passes(ROOT) == []


def test_a_rule_planted_in_an_actor_is_found():
    source = (ROOT / "actors/trainer.py").read_text()
    planted = source.replace("    async def ping(self) -> None:\n",
                             "    async def ping(self) -> None:\n        if self.config.device == 'auto':\n"
                             "            self.config.device = 'cpu'\n", 1)
    assert planted != source
    found = settling_outside_the_passes(ROOT, {"actors/trainer.py": planted})
    assert len(found) == 1 and found[0].startswith("actors/trainer.py:") and found[0].endswith("(ping)")
    handed = source.replace("    async def ping(self) -> None:\n",
                            "    async def ping(self) -> None:\n        resolve_device('auto')\n", 1)
    assert [f.endswith("(ping)") for f in settling_outside_the_passes(ROOT, {"actors/trainer.py": handed})] == [True]


def settled(name: str, overrides: list[str], run_dir: Path, judged: bool = False):
    """The named config as a run on a machine without a GPU settles it, on a CPU without bf16 math."""
    config = resolve(load_config(name, overrides), run_dir)
    config.logging.wandb_mode = wandb_mode(config.logging)  # as the run does before its loggers start
    placement = plan(config)
    gpus = plan_gpus(config, placement, 0)
    choice = Bf16Choice(False, "a CPU without bf16 math (a stand-in choice)")
    apply_dtypes(config, {role: choice for role in ("generator", "trainer", "reference", "judge")},
                 {"generator", "trainer", "reference"} | ({"judge"} if judged else set()))
    path = resolve_checkpoint(config.model.source)
    return settle(gpus.apply(config), placement, path, read_hf_config(path), run_dir, judged, bool(gpus.shared))


def test_a_run_on_this_machine_settles_every_auto_by_its_rule(tmp_path):
    config = settled("smoke", [], tmp_path)
    assert unsettled(to_dict(config)) == []
    t, w, g = config.trainer, config.weight_sync, config.generator
    assert (t.device, config.reference.device) == ("cpu", "cpu")  # no GPU here: the plan gave none
    assert (t.activation_checkpointing, t.bf16_all_gather) == ("off", "off")  # models/memory.py's CPU choice
    assert (w.staging, w.memory, w.relay, w.transport) == ("pageable", "host", "off", "shm")
    assert (g.engine.cuda_graphs, g.engine.sleep, t.lora.serving) == ("off", "off", "merged")
    assert config.grader.judge.dtype == UNUSED and config.job.gpu_sharing == "off"
    assert Path(config.model.chat_template).read_text() == chat_template(resolve_checkpoint("tiny"), "auto")
    assert config.model.tool_parser not in ("", "auto")
    assert settled("smoke", [], tmp_path) == config  # settling is a function of the run's facts


def test_only_the_transport_stays_per_reader_where_the_roles_have_hosts_of_their_own(tmp_path):
    config = settled("smoke", ["--job.kind", "workers", "--job.workers", "tcp://a:1,tcp://b:1", "--job.tls.insecure",
                               "true", "--job.hosts",
                               "trainer:1,generators:1", "--trainer.hosts", "trainer", "--generator.hosts",
                               "generators"], tmp_path)
    assert unsettled(to_dict(config)) == ["weight_sync.transport"]


def test_resolved_json_is_what_the_roles_are_started_with(tmp_path):
    """The settled config written, and read back as `meshrl report` reads it."""
    from meshrl.runtime.settle import write
    from meshrl.tools.report import settled as report_settled

    config = settled("smoke", [], tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(load_config("smoke", []))))
    write(config, tmp_path)
    assert json.loads((tmp_path / "resolved.json").read_text()) == to_dict(config)
    shown = report_settled(tmp_path)
    assert shown["weight_sync.staging"] == "auto -> pageable" and shown["trainer.device"] == "auto -> cpu"
    assert "controller.steps" not in shown  # asked, not settled
