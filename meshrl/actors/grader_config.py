"""The grader role's config section (`grader`, with its judge's `grader.judge`): what any grader implementation
is given, its checks. A module of its own beside meshrl/actors/grader.py and judge.py, which import Monarch;
it loads no torch, as a grader's process never does (tests/test_layout.py). A run's config (meshrl/configs)
composes it; values that depend on other sections are filled in once by meshrl.configs.resolve before anything
is spawned."""

from dataclasses import dataclass, field

from meshrl.checks import at_least


def check_rubric(rubric: str) -> None:
    """A judge's rubric must name the reply and only the fields a judge is given."""
    try:
        rubric.format(question="", reference="", reply="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"grader.judge.rubric may use only {{question}}, {{reference}} and {{reply}} ({e!r})") from None
    if "{reply}" not in rubric:
        raise ValueError("grader.judge.rubric must show the judge the {reply}")


@dataclass
class JudgeConfig:
    """The model-judged grader (grader.impl meshrl.actors.judge:JudgeGrader): a language model, served
    by vLLM in each grader replica, says whether a reply answers the question."""

    model: str = "smollm2"  # the judge: smollm2 (embedded) | an HF checkpoint directory
    rubric: str = ""  # its prompt, with {question}, {reference} and {reply}, asking for a yes or no; "": the built-in one
    rule_weight: float = 0.0  # the task's own reward mixed in: reward = (1 - w) * P(yes) + w * task reward
    max_model_len: int = 1024  # vLLM's context length for the judge
    dtype: str = "auto"  # as generator.dtype
    memory_fraction: float = 0.2  # vLLM's gpu_memory_utilization
    kv_cache_gib: int = 1  # vLLM's CPU KV cache
    num_threads: int = 1  # torch/OpenMP threads of each replica's judge
    cpus: str = ""  # pin each grader replica to these cores; "" leaves placement to the OS
    devices: str = ""  # CUDA_VISIBLE_DEVICES of the grader replicas ("": what the process sees)

    def check(self) -> None:
        if not 0 <= self.rule_weight <= 1:
            raise ValueError(f"grader.judge.rule_weight must be in [0, 1], not {self.rule_weight:g}")
        if self.rubric:
            check_rubric(self.rubric)


@dataclass
class GraderConfig:
    """Scores completions with the task's reward function (or a judge model, with JudgeGrader)."""

    impl: str = "meshrl.actors.grader:TaskGrader"  # the actor class, module:Class
    replicas: int = 1  # grader actors; groups go to the least loaded
    max_restarts: int = 3  # a replica failing more than this many times in a row, each within controller.restart_window_s of its start, stops the run (a crash loop)
    hosts: str = ""  # the job.hosts group the replicas go on, round-robin over its hosts; "": the controller's host
    timeout_s: float = 300.0  # one group's grading: past it the replica is replaced
    zero_truncated: bool = False  # a completion cut off at generator.max_tokens scores 0 (its checks stay the task's): the model learns to end its reply (single-turn tasks)
    warn_error_fraction: float = 0.1  # a step's share of replies whose reward function raised, above it: a warning
    max_error_fraction: float = 0.5  # that share above it for max_error_steps steps in a row stops the run
    max_error_steps: int = 3  # steps in a row (see max_error_fraction)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def check(self) -> None:
        at_least(self, "grader", replicas=1, max_restarts=0, max_error_steps=1)
        for name in ("warn_error_fraction", "max_error_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"grader.{name} must be between 0 and 1, not {getattr(self, name):g}")
        self.judge.check()
