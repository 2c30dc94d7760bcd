"""A second grader: a language model judges each reply (`--grader.impl meshrl.actors.judge:JudgeGrader`).

Generative reward models and LLM judges grade what rules cannot (free-form answers, rubrics). Each
grader replica serves the judge with vLLM in its own process and asks it, through a rubric prompt,
whether a reply gives the reference answer to the question. The score is the judge's probability of
"yes" against "no" for its first token (read from the top log-probabilities, so a weak judge still
gives a graded signal and never an unparsable one), optionally mixed with the task's own reward. The
task's checks are kept (accuracy still means what the task says), with `judge_yes` and, where the task
has an accuracy check, `judge_agrees`: how often the judge's verdict matches it.

It follows the Grader contract (meshrl/actors/roles.py), so the controller does not know which grader
runs; its failures (the engine raising, the replica dying) are handled like any grader's.
"""

import math

from meshrl.actors.engine import start_vllm
from meshrl.actors.grader import TaskGrader
from meshrl.actors.grader_config import GraderConfig, check_rubric
from meshrl.models.model import ChatTokenizer, resolve_checkpoint
from meshrl.types import Reply, Sample

RUBRIC = """You are grading a reply to a question against the reference answer.

Question: {question}

Reference answer: {reference}

Reply: {reply}

Does the reply give the reference answer? Answer yes or no."""
TOP = 20  # log-probabilities read for the verdict's token


def p_yes(top: dict[str, float]) -> float | None:
    """P(yes) / (P(yes) + P(no)) from the first token's top log-probabilities {token text: logprob}
    (any case, surrounding spaces ignored); None when neither is among them."""
    yes = sum(math.exp(lp) for token, lp in top.items() if token.strip().lower() == "yes")
    no = sum(math.exp(lp) for token, lp in top.items() if token.strip().lower() == "no")
    return yes / (yes + no) if yes + no > 0 else None


class JudgeGrader(TaskGrader):
    """roles.Grader: scores by a judge model (GraderConfig.judge), with the task's reward mixed in by
    `rule_weight`."""

    def __init__(self, task: str, task_config, config: GraderConfig):
        super().__init__(task, task_config, config)
        self.judge = config.judge
        self.rubric = self.judge.rubric or RUBRIC
        check_rubric(self.rubric)
        checkpoint = resolve_checkpoint(self.judge.model)
        self.tokenizer = ChatTokenizer(checkpoint)
        self.llm = start_vllm(str(checkpoint), dtype=self.judge.dtype, max_model_len=self.judge.max_model_len,
                              memory_fraction=self.judge.memory_fraction, seed=0, num_threads=self.judge.num_threads,
                              cpus=self.judge.cpus, kv_cache_gib=self.judge.kv_cache_gib, devices=self.judge.devices)

    def scores(self, completions: list[Reply], sample: Sample) -> list[tuple[float, dict[str, float]] | None]:
        """The judge's score of each; None where the task's reward raises (logged), as with the rule grader."""
        rules = self.rewards(completions, sample)
        verdicts = self.verdicts([c.text for c in completions], sample)
        w, accuracy = self.judge.rule_weight, self.task.accuracy
        scored = []
        for (rule, checks), yes in zip(rules, verdicts):
            if rule is None:
                scored.append(None)
                continue
            parsed, yes = yes is not None, yes or 0.0  # no yes or no among its tokens: scored 0
            checks = {**checks, "judge_yes": yes, "judge_parsed": float(parsed)}
            if accuracy in checks:
                checks["judge_agrees"] = float((yes > 0.5) == (checks[accuracy] >= 0.5))
            scored.append(((1 - w) * yes + w * rule, checks))
        return scored

    def verdicts(self, replies: list[str], sample: Sample) -> list[float | None]:
        """The judge's P(yes) for each reply (None when neither yes nor no is among its likeliest first
        tokens). A rubric longer than judge.max_model_len is refused by vLLM: its group fails."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        reference = sample.info.get("reference", sample.answer)
        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode_chat(
            self.rubric.format(question=sample.prompt, reference=reference, reply=reply))) for reply in replies]
        outputs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP), use_tqdm=False)
        verdicts = []
        for output in outputs:
            first = output.outputs[0].logprobs[0]
            yes = p_yes({lp.decoded_token or "": lp.logprob for lp in first.values()})
            verdicts.append(yes)
        return verdicts
