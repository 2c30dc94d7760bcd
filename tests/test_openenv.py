"""OpenEnv environments as meshrl sessions (meshrl/tasks/openenv.py): a Zorplex lookup environment written
against openenv's Environment (tests/openenv_envs.py) gives the same transcripts and rewards as native Zorplex
for scripted replies; the seeds of the splits are disjoint; replies parse into actions; and real runs of
`meshrl train` on the tiny model train it in the grader's process, served on 127.0.0.1 with concurrent
sessions, and through a grader killed mid-group. An MCP environment's tools are offered to the model through the chat
template (`tools=`) and its replies are read by vLLM's tool parser of the model's format."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="openenv is installed from requirements-openenv.txt, not the lock")

from openenv_envs import NATIVE, ZorplexLookupEnv  # noqa: E402

from meshrl.models.model import ChatTokenizer, ModelError, resolve_checkpoint  # noqa: E402
from meshrl.tasks.conversation import converse  # noqa: E402
from meshrl.tasks.openenv import SEEDS, OpenEnvConfig, OpenEnvTask, parse_action  # noqa: E402
from meshrl.types import Generated, Sampling  # noqa: E402
from meshrl.tasks.zorplex import SYSTEM, Zorplex  # noqa: E402

HERE = Path(__file__).resolve().parent
ZORPLEX = ["--openenv.system", SYSTEM, "--openenv.role", "tool", "--openenv.stop", '["]"]', "--openenv.accuracy",
           "correct", "--openenv.action", "text"]


def openenv_task(**kw) -> OpenEnvTask:
    return OpenEnvTask(OpenEnvConfig(env="openenv_envs:ZorplexLookupEnv", system=SYSTEM, role="tool", stop='["]"]',
                                     accuracy="correct", **kw))


def test_scripted_replies_give_native_zorplexs_transcripts_and_rewards():
    native, task = Zorplex(NATIVE), openenv_task()

    async def episode(sample, replies):
        messages = await task.open("s", sample)
        for reply in replies:
            messages.append({"role": "assistant", "content": reply})
            answer, _ = await task.step("s", reply)
            if answer is None:
                break
            messages += answer
        reward, checks, metadata = await task.finish("s")
        await task.close("s")
        return messages, reward, checks, metadata

    compared = 0
    for index in range(4):
        sample = native.train_sample(index)
        words, answer = list(sample.info["values"]), sample.answer
        for replies in ([f"LOOKUP[{w}]" for w in words] + [f"Answer: {answer}"], ["LOOKUP[nosuch]", "Answer: 3"],
                        [f"LOOKUP[{words[0]}]", "I do not know."], [f"Answer: {answer}"]):
            messages = native.opening(sample)
            for reply in replies:
                messages.append({"role": "assistant", "content": reply})
                if (more := native.step(sample, messages)) is None:
                    break
                messages += more
            reward, checks = native.conversation_reward(sample, messages)
            ours, our_reward, our_checks, metadata = asyncio.run(episode(task.train_sample(index), replies))
            assert ours == messages and our_reward == pytest.approx(reward)
            assert {k: our_checks[k] for k in checks} == checks and our_checks["done"] == 1.0
            assert metadata["rewards"][-1] == pytest.approx(reward) and sum(metadata["rewards"]) == pytest.approx(reward)
            compared += 1
    assert compared == 16 and ZorplexLookupEnv.alive == 0  # every session closed


def test_the_splits_reset_with_disjoint_seeds_and_the_same_index_gives_the_same_seed():
    task = openenv_task(eval_size=50)
    train = {task.train_sample(i).info["seed"] for i in range(1000)}
    validation = {s.info["seed"] for s in task.eval_samples("validation")}
    test = {s.info["seed"] for s in task.eval_samples("test")}
    assert len(train) == 1000 and len(validation) == len(test) == 50
    assert not (train & validation or train & test or validation & test)
    assert task.train_sample(7) == task.train_sample(7) and task.eval_samples("test") == task.eval_samples("test")
    assert min(validation) == SEEDS["validation"] and max(train) < SEEDS["validation"] <= max(validation) < SEEDS["test"]
    with pytest.raises(ValueError, match="eval split"):
        task.eval_samples("train")


def test_replies_parse_into_text_and_json_actions():
    assert parse_action("LOOKUP[zorp]", "text", "message") == {"message": "LOOKUP[zorp]"}
    assert parse_action('I move: ```json\n{"x": 1, "y": {"z": 2}}\n``` done', "json") == {"x": 1, "y": {"z": 2}}
    assert parse_action("no action here {", "json") is None
    with pytest.raises(ValueError, match="one of openenv.env"):
        OpenEnvConfig().check()
    with pytest.raises(ValueError, match="openenv.stop"):
        OpenEnvConfig(env="a:B", stop="]").check()
    from meshrl.configs.named import load_config

    with pytest.raises(ValueError, match="openenv.max_sessions 3 leaves no room for a group's sessions"):
        load_config("smoke", ["--task", "openenv", "--openenv.env", "a:B", "--openenv.max_sessions", "3"]).check()


def train(tmp_path: Path, *args, env: dict | None = None) -> tuple[list[dict], list[dict]]:
    """`meshrl train --config smoke` on an OpenEnv environment, 3 steps: its metrics and rollouts."""
    run = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
                          "--checkpoint.every", "0", "--task", "openenv", *ZORPLEX, "--openenv.eval_size", "2",
                          "--controller.steps", "3", "--controller.max_turns", "3", *args],
                         capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    read = lambda name: [json.loads(line) for line in (tmp_path / "run" / name).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read("rollouts.jsonl")


@pytest.mark.processes
def test_an_openenv_environment_trains_in_the_graders_process_through_a_grader_killed_mid_group(tmp_path):
    """Two grader replicas; the environment kills its grader's process at the first step of train seed 1 (prompt
    1), once: that group is generated again on the other replica (counted), no group fails, every prompt trains."""
    mark = tmp_path / "killed"
    metrics, rollouts = train(tmp_path, "--openenv.env", "openenv_envs:ZorplexKillerEnv", "--grader.replicas", "2",
                              env={"MESHRL_TEST_KILL_MARK": str(mark)})
    assert mark.exists() and [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["groups_regenerated"] for m in metrics] == [1, 0, 0] and metrics[-1]["grader_restarts"] == 1
    assert sum(m["groups_failed"] for m in metrics) == 0
    assert sorted({r["group"] for r in rollouts}) == list(range(6)) and len(rollouts) == 6 * 4
    # each episode's metadata is kept; a group's 4 sessions were open in its grader at once
    assert all(r["metadata"]["metadata"]["open_sessions"] >= 4 and r["reward_components"]["done"] == 1.0
               for r in rollouts)
    assert all(r["metadata"]["rewards"] == [r["reward"]] for r in rollouts)  # done at its first step: one reward


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.processes
def test_a_served_openenv_environment_trains_with_concurrent_sessions_each_closed(tmp_path):
    """The environment served by openenv's create_app on 127.0.0.1, one WebSocket session per conversation; it
    never ends an episode on a random model's replies, so every conversation is truncated at max_turns. A
    session opened afterwards is the server's only one: every session of the run was closed. The server takes 4
    sessions at most, one group's: `openenv.max_sessions 4` has groups wait for room, and none fails."""
    port = free_port()
    server = subprocess.Popen([sys.executable, str(HERE / "openenv_envs.py"), str(port), "ZorplexPatientEnv", "4"])
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        metrics, rollouts = train(tmp_path, "--openenv.url", f"ws://127.0.0.1:{port}", "--openenv.max_sessions", "4")
        assert [m["step"] for m in metrics] == [1, 2, 3] and sum(m["groups_failed"] for m in metrics) == 0
        assert len(rollouts) == 3 * 2 * 4 and all(r["turns"] == 3 for r in rollouts)
        assert all("<|im_start|>tool\nWrite LOOKUP[word], or Answer: N.<|im_end|>" in r["completion"] for r in rollouts)
        assert max(r["metadata"]["metadata"]["open_sessions"] for r in rollouts) == 4  # a group's, side by side
        assert all(r["reward_components"]["done"] == 0.0 and len(r["metadata"]["rewards"]) == 3 for r in rollouts)

        from openenv.core.generic_client import GenericEnvClient

        async def alone() -> int:
            client = GenericEnvClient(base_url=f"ws://127.0.0.1:{port}")
            try:
                return (await client.reset(seed=0)).metadata["open_sessions"]
            finally:
                await client.close()
        assert asyncio.run(alone()) == 1
    finally:
        server.kill()
        server.wait()


def test_a_grader_without_session_endpoints_cannot_serve_openenv():
    from meshrl.configs.named import load_config
    from meshrl.runtime.launch import actor_classes

    config = load_config("smoke", ["--task", "openenv", "--openenv.env", "openenv_envs:ZorplexLookupEnv",
                                   "--grader.impl", "user_task:ScoreOnlyGrader"])
    with pytest.raises(ValueError, match="user_task:ScoreOnlyGrader cannot be the grader: it has no step, "
                                         "open_sessions, step_sessions, close_sessions endpoint"):
        actor_classes(config)
    assert actor_classes(load_config("smoke", ["--task", "openenv", "--openenv.env", "openenv_envs:ZorplexLookupEnv"]))


@pytest.fixture(scope="module")
def smollm2():
    return resolve_checkpoint("smollm2")


def mcp_task(smollm2, **kw) -> OpenEnvTask:
    """The Zorplex MCP environment with tool calls read as a run's graders read them: launched with model.tool_parser
    auto (SmolLM2's family: vLLM's hermes parser) and the checkpoint."""
    config = OpenEnvConfig(env="openenv_envs:ZorplexToolEnv", action="tool_call", role="tool", **kw)
    return OpenEnvTask(config.launched("auto", smollm2))


@pytest.mark.processes
def test_tool_calls_step_an_mcp_environment_and_its_results_are_the_tool_turns(smollm2):
    task, last = mcp_task(smollm2), mcp_task(smollm2, reward="last")
    sample = task.train_sample(2)
    values = Zorplex(NATIVE).train_sample(2).info["values"]
    [(word, value)] = values.items()
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format  # noqa: E731

    async def episode(replies, task=task):
        turns = [await task.open("m", sample)]
        for reply in replies:
            answer, _ = await task.step("m", reply)
            turns.append(answer)
            if answer is None:
                break
        result = await task.finish("m")
        await task.close("m")
        return turns, result

    replies = ["I look it up. " + call("lookup", json.dumps({"word": word})), call("lookup", '{"word": "nosuch"}'),
               call("nosuch", "{}"), call("answer", json.dumps({"value": value}))]
    turns, (reward, checks, metadata) = asyncio.run(episode(replies))
    assert turns[0] == [{"role": "user", "content": Zorplex(NATIVE).train_sample(2).prompt}]
    assert turns[1:4] == [[{"role": "tool", "content": str(value)}], [{"role": "tool", "content": "unknown word"}],
                          [{"role": "tool", "content": "error: Unknown tool: 'nosuch'"}]]
    assert turns[4] is None and checks["success"] == checks["done"] == 1.0
    assert metadata["rewards"] == [0.1, 0.0, 0.0, 1.0] and reward == pytest.approx(1.1)  # the steps' sum
    assert asyncio.run(episode(replies, last))[1][0] == 1.0  # openenv.reward last
    turns, (reward, checks, _) = asyncio.run(episode(["The answer is 12.", call("answer", '{"value": 0}')]))
    assert turns[1:] == [None] and reward == 0.0 and checks["invalid_action"] == 1.0 and checks["done"] == 0.0
    # a malformed call (its JSON cut off) is no call: the episode ends there, with no action
    turns, (reward, checks, _) = asyncio.run(episode(['<tool_call>\n{"name": "lookup", "arguments": {"word": \n'
                                                      '</tool_call>', call("answer", json.dumps({"value": value}))]))
    assert turns[1:] == [None] and reward == 0.0 and checks["invalid_action"] == 1.0 and checks["done"] == 0.0
    unlaunched = OpenEnvTask(OpenEnvConfig(env="openenv_envs:ZorplexToolEnv", action="tool_call"))
    asyncio.run(unlaunched.open("u", sample))
    with pytest.raises(ValueError, match=r"build the task from OpenEnvConfig\.launched"):
        asyncio.run(unlaunched.step("u", call("answer", "{}")))
    asyncio.run(unlaunched.close("u"))


@pytest.mark.processes
def test_an_mcp_environments_tools_are_in_the_prompt_and_a_reply_in_the_templates_format_steps_it(smollm2, tmp_path):
    """A session group as a run carries it: the grader (its endpoints' bodies, called in this process) opens the
    session and answers an Opening with the session's tools (its ListToolsAction answer); `converse` renders with
    the tokenizer offering them, so SmolLM2 under the hermes template sees their schemas in its system turn; a
    reply written in that template's tool-call format is read by vLLM's hermes parser into the CallToolAction the
    environment answers (the word's value, a step reward); SmolLM2's own template, which ignores tools, stops
    the run before it starts, and a run's graders get the parser resolved."""
    from meshrl.actors.grader import TaskGrader

    grader = TaskGrader("openenv", OpenEnvConfig(env="openenv_envs:ZorplexToolEnv", action="tool_call", role="tool")
                    .launched("auto", smollm2))
    endpoint = lambda name: getattr(TaskGrader, name)._method  # noqa: E731 (the function under Monarch's @endpoint)
    sample = grader.task.train_sample(2)
    [(word, value)] = Zorplex(NATIVE).train_sample(2).info["values"].items()
    opened = asyncio.run(endpoint("open_sessions")(grader, sample, ["t"]))
    opening, tools = opened.messages, opened.tools
    assert [t["function"]["name"] for t in tools] == ["lookup", "answer"]
    assert tools[0]["function"]["parameters"]["properties"] == {"word": {"type": "string"}}
    tokenizer = ChatTokenizer(smollm2, "hermes")
    # the model's turn as the template writes a call: content, then <tool_call> JSON </tool_call>
    written = tokenizer.render([{"role": "assistant", "content": "I look it up.", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}}]}],
        add_generation_prompt=False).split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert "<tool_call>" in written
    prompts, answers = [], []

    async def generate(batch, sampling):
        prompts.extend(batch)
        ids = tokenizer.tokenizer.encode(written, add_special_tokens=False).ids
        return [Generated(len(prompts), 0, len(batch[0].token_ids), len(ids), 0, "stop", tail=ids[-8:], text=written)]

    async def step(conversations, last, sessions):
        replies = await endpoint("step_sessions")(grader, sessions, [m[-1]["content"] for m in conversations], last)
        answers.extend(replies)
        return replies

    scored, failed = asyncio.run(converse(0, opening, Sampling(n=1, temperature=1.0, max_tokens=48), 1, 4096, tokenizer.offering(tools), generate,
                                          step, sessions=["t"]))
    assert failed == 0 and len(scored) == 1 and not grader.task.episodes  # ended: closed
    shown = tokenizer.tokenizer.decode(prompts[0].token_ids, skip_special_tokens=False)
    system = shown.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    assert all(json.dumps(t) in system for t in tools)  # each tool's schema, as the template writes it (tojson)
    assert prompts[0].token_ids == tokenizer.encode_messages(opening, tools=tools)
    assert "<tools>" not in tokenizer.tokenizer.decode(tokenizer.encode_messages(opening), skip_special_tokens=False)
    # lookup(word) was called: the environment's step reward, and its answer in the episode's only step
    assert answers[0].reward == pytest.approx(0.1) and answers[0].metadata["rewards"] == [0.1]
    assert answers[0].checks["invalid_action"] == 0.0 and scored[0].reward == pytest.approx(0.1)

    from meshrl.configs.named import load_config
    from meshrl.runtime.run import Run

    flags = ["--task", "openenv", "--openenv.env", "openenv_envs:ZorplexToolEnv", "--openenv.action", "tool_call"]
    with pytest.raises(ModelError, match="ignores tools: set model.chat_template"):
        Run(load_config("smoke", flags), tmp_path / "run")
    assert Run(load_config("smoke", [*flags, "--model.chat_template", "hermes"]), tmp_path / "run").grader_task \
        .tool_parser == "hermes"


def test_a_resume_may_move_the_served_environment_but_not_change_the_environment():
    from meshrl.configs import ConfigError, resumable_overrides
    from meshrl.configs.named import load_config

    served = ["--task", "openenv", "--openenv.url", "ws://127.0.0.1:8000"]
    saved = load_config("smoke", served)
    resumable_overrides(saved, load_config("smoke", [*served[:3], "ws://10.0.0.2:9000", "--openenv.max_sessions", "8"]))
    with pytest.raises(ConfigError, match=r"--openenv\.action cannot change on resume"):
        resumable_overrides(saved, load_config("smoke", [*served, "--openenv.action", "json"]))
