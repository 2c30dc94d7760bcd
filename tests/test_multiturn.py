"""Multi-turn rollouts: the chat-template tokens between turns, episodes (one per trajectory, or one per
turn with step-wise advantages, checked by hand on fake completions), the Zorplex environment's rules,
a conversation of real SmolLM2 in vLLM with the environment in a real grader actor (its loss mask
decoded), a later turn sent as its new tokens only to a replica that did not generate the turn before, and
smoke runs through `meshrl train`."""

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
from assertions import assert_checks_are_the_means_of_the_records, assert_staleness_bound

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.torch_generator import TorchGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.grader import EnvReply, TaskGrader
from meshrl.configs import ControllerConfig
from meshrl.configs.named import load_config
from meshrl.episodes import build_episodes
from meshrl.models.model import ChatTokenizer, resolve_checkpoint
from meshrl.tasks.conversation import converse
from meshrl.runtime.launch import actor_classes
from meshrl.tasks.zorplex import Zorplex, ZorplexConfig, calculate
from meshrl.types import Completion, Generated, Prompt, Sampling, ScoredCompletion, Trajectory
from meshrl.weight_sync import WeightSyncConfig


@pytest.fixture(scope="module")
def smollm2():
    return resolve_checkpoint("smollm2")


def test_the_tokens_between_turns_are_the_templates_and_the_models_own_stay(tiny_checkpoint):
    tokenizer = ChatTokenizer(tiny_checkpoint)
    opening = [{"role": "user", "content": "What is the value of zorp?"}]
    tool = [{"role": "tool", "content": "17"}]
    reply = tokenizer.tokenizer.encode("LOOKUP[zorp]", add_special_tokens=False).ids
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    conversation = [*opening, {"role": "assistant", "content": "LOOKUP[zorp]"}]
    whole = tokenizer.encode_messages([*conversation, *tool])
    for ids in (reply, reply + [eos]):  # stopped at the tool call's "]", or at its end of turn
        after = tokenizer.continuation(conversation, ids, tool)
        assert tokenizer.encode_messages(opening) + ids + after == whole
    assert tokenizer.tokenizer.decode(tokenizer.continuation(conversation, reply + [eos], tool),
                                      skip_special_tokens=False) == "\n<|im_start|>tool\n17<|im_end|>\n<|im_start|>assistant\n"


def fake_turn(prompt: list[int], tokens: list[int], version: int) -> Completion:
    """A fake Completion: its logprobs are -(token id), to see where each lands."""
    return Completion(0, prompt, tokens, [-float(t) for t in tokens], "", version, "stop")


def test_episodes_of_trajectories_and_step_wise_advantages_by_hand():
    # trajectory A: prompt [1, 2], model [3], environment [4], model [5, 6]; trajectory B: one turn
    a1 = fake_turn([1, 2], [3], version=2)
    a2 = fake_turn([1, 2, 3, 4], [5, 6], version=3)
    b1 = fake_turn([1, 2], [7, 8], version=3)
    held = [[a1, a2], [b1]]  # as the replay buffer takes them from the generators
    # as the controller has them: each turn's Generated
    group = [ScoredCompletion(Trajectory([Generated.of(0, a1), Generated.of(1, a2)], ""), 1.0),
             ScoredCompletion(Trajectory([Generated.of(2, b1)], ""), 0.0)]

    whole = build_episodes(group, 9, ControllerConfig(advantage="rloo"), 1.0, sequences=held)  # rloo: 1 - 0 = 1 and 0 - 1 = -1
    assert [e.tokens.tolist() for e in whole] == [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8]]
    assert whole[0].loss_mask.tolist() == [False, False, True, False, True, True]
    assert whole[0].behaviour_logprobs.tolist() == [0.0, 0.0, -3.0, 0.0, -5.0, -6.0]
    assert [e.advantage for e in whole] == [1.0, -1.0]
    assert [e.policy_version for e in whole] == [2, 3]  # a trajectory is as old as its oldest turn

    steps = build_episodes(group, 9, ControllerConfig(advantage="step_wise_rloo"), 1.0, sequences=held)
    assert [e.tokens.tolist() for e in steps] == [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]]
    assert [e.loss_mask.tolist() for e in steps] == [[False, False, True], [False, False, False, False, True, True],
                                            [False, False, True, True]]
    assert [e.advantage for e in steps] == [1.0, 1.0, -1.0]  # the trajectory's advantage on each of its turns
    assert [e.policy_version for e in steps] == [2, 2, 3]
    divided = build_episodes(group, 9, ControllerConfig(advantage="step_wise_rloo", divide_by_turns=True), 1.0,
                             sequences=held)
    assert [e.advantage for e in divided] == [0.5, 0.5, -1.0]
    grpo = build_episodes(group, 9, ControllerConfig(advantage="step_wise_grpo"), 1.0, sequences=held)  # mean 0.5, std 0.5: +-1
    assert [round(e.advantage, 4) for e in grpo] == [1.0, 1.0, -1.0]


def test_conversations_end_at_max_turns_when_out_of_context_or_when_the_environment_fails(tiny_checkpoint):
    """`converse` with a fake generator (each turn "hi" plus the end of turn, whose text is "hi", as vLLM
    gives it without the special token) and a fake environment that always answers unless told it is the
    last turn, and fails on conversation 2's second turn. Each later turn names the turn before it."""
    tokenizer = ChatTokenizer(tiny_checkpoint)
    hi = tokenizer.tokenizer.encode("hi", add_special_tokens=False).ids + [tokenizer.tokenizer.token_to_id("<|im_end|>")]
    calls, held = [], {}
    opening = [{"role": "user", "content": "go"}]

    async def generate(prompts, sampling):
        calls.append((len(prompts), sampling.n))
        out = []
        for p in prompts:
            # the opening is sent whole; a later turn's prompt is its new tokens only, after the turn it names
            assert (p.prefix is None) == (p.token_ids == tokenizer.encode_messages(opening))
            before = held[p.prefix].prompt_tokens + held[p.prefix].num_tokens if p.prefix is not None else 0
            for _ in range(sampling.n):
                held[len(held)] = turn = Generated(len(held), 0, before + len(p.token_ids), len(hi), len(calls), "stop",
                                                   tail=hi, text="hi")
                out.append(turn)
        return out

    async def step(conversations, last):
        replies = []
        for i, messages in enumerate(conversations):
            turns = sum(m["role"] == "assistant" for m in messages)
            fails = len(conversations) == 3 and i == 2 and turns == 2
            replies.append(EnvReply(failed=fails) if fails or last else EnvReply([{"role": "tool", "content": "x"}]))
        return replies

    sampling = Sampling(n=3, temperature=1.0, max_tokens=4)
    scored, failed = asyncio.run(converse(0, opening, sampling, 3, 512, tokenizer, generate, step))
    assert failed == 1 and [len(s.completion.turns) for s in scored] == [3, 3]
    assert calls == [(1, 3), (3, 1), (2, 1)]  # the group's first turn, then one call per turn for those going on
    assert [s.completion.policy_version for s in scored] == [1, 1]  # as old as their first turn
    # each turn's text and the template's tokens between (the model's own end of turn not in its text)
    assert scored[0].completion.text == "hi\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n" * 2 + "hi"
    between = tokenizer.continuation([*opening, {"role": "assistant", "content": ""}], hi,
                                     [{"role": "tool", "content": "x"}])
    second_prompt = len(tokenizer.encode_messages(opening)) + len(hi) + len(between)
    scored, failed = asyncio.run(converse(0, opening, Sampling(n=1, temperature=1.0, max_tokens=4), 3, second_prompt + 4, tokenizer,
                                          generate, step))
    assert failed == 0 and len(scored[0].completion.turns) == 2  # a third turn would not fit


def test_zorplex_answers_tool_calls_and_scores_the_conversation():
    env = Zorplex(ZorplexConfig(level=2))
    sample = env.train_sample(3)
    (w1, v1), (w2, v2) = sample.info["values"].items()
    assert sample.answer == str(v1 + v2) and w1 in sample.prompt and w2 in sample.prompt
    assert env.train_sample(3) == sample and env.train_sample(4) != sample and env.eval_samples()[0] != sample
    opening = env.opening(sample)
    assert opening[-1] == {"role": "user", "content": sample.prompt} and "LOOKUP[blick]" in str(opening)

    def say(*turns):
        messages = list(opening)
        for text in turns:
            messages.append({"role": "assistant", "content": text})
            if (answer := env.step(sample, messages)) is None:
                return messages, None
            messages += answer
        return messages, answer

    assert say(f"LOOKUP[{w1}]")[1] == [{"role": "tool", "content": str(v1)}]
    assert say("LOOKUP[nosuch]")[1] == [{"role": "tool", "content": "unknown word"}]
    assert say("I do not know.")[1] is None and say(f"Answer: 3 LOOKUP[{w1}]")[1] is None
    right, _ = say(f"LOOKUP[{w1}]", f"LOOKUP[{w2}]", f"Answer: {v1 + v2}")
    assert env.conversation_reward(sample, right) == (1.1, {"correct": 1.0, "tagged": 1.0, "tool_call": 1.0})
    guessed, _ = say(f"LOOKUP[{w1}]", f"Answer: {v1 + v2}")  # right, but one word never looked up
    assert env.conversation_reward(sample, guessed) == (1.0, {"correct": 1.0, "tagged": 1.0, "tool_call": 0.0})
    untagged, _ = say(f"LOOKUP[{w1}]", f"LOOKUP[{w2}]", f"It is {v1 + v2}.")
    assert env.conversation_reward(sample, untagged) == (pytest.approx(0.1), {"correct": 0.0, "tagged": 0.0, "tool_call": 1.0})
    with pytest.raises(ValueError, match="zorplex level"):
        Zorplex(ZorplexConfig(level=3))


def test_the_calculator_answers_arithmetic_only_and_its_use_is_reported():
    assert [calculate(e) for e in ("42+17", " 3*4-2 ", "-(5-9)*2", "7")] == [59, 10, 8, 7]
    assert [calculate(e) for e in ("__import__('os')", "2**10", "1/2", "3.5+1", "x+1", "", "9" * 7 + "*" + "9" * 7)] \
        == [None] * 7
    env = Zorplex(ZorplexConfig(level=2, calculator=True))
    sample = env.eval_samples("test")[0]
    (w1, v1), (w2, v2) = sample.info["values"].items()
    opening = env.opening(sample)
    assert "CALC[expression]" in opening[0]["content"]
    assert {"role": "assistant", "content": "CALC[42+17]"} in opening and {"role": "tool", "content": "59"} in opening
    messages = list(opening)
    for text in (f"LOOKUP[{w1}]", f"LOOKUP[{w2}]", f"CALC[{v1}+{v2}]", "CALC[2**3]"):
        messages.append({"role": "assistant", "content": text})
        messages += env.step(sample, messages)
    assert [m["content"] for m in messages[-8:] if m["role"] == "tool"] == [str(v1), str(v2), str(v1 + v2),
                                                                            "bad expression"]
    messages.append({"role": "assistant", "content": f"Answer: {v1 + v2}"})
    assert env.step(sample, messages) is None
    assert env.conversation_reward(sample, messages) == (1.1, {"correct": 1.0, "tagged": 1.0, "tool_call": 1.0, "calculated": 1.0})
    # without the calculator a CALC call is no tool call: the turn ends the conversation
    plain = Zorplex(ZorplexConfig(level=2))
    assert plain.step(sample, plain.opening(sample) + [{"role": "assistant", "content": "CALC[1+2]"}]) is None
    assert "CALC" not in str(plain.opening(sample))


@pytest.mark.processes
def test_smollm2_looks_up_in_the_environment_and_only_its_own_tokens_are_trained(smollm2):
    """Real SmolLM2 in vLLM (greedy), the Zorplex environment in a real grader actor: conversations
    with tool results in between, whose loss mask covers exactly the model's tokens."""
    tokenizer = ChatTokenizer(smollm2)
    env = Zorplex(ZorplexConfig())
    samples = env.eval_samples()[:6]

    async def run():
        gen_procs, generator = spawn("generator", VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=2), WeightSyncConfig(),
                                     str(smollm2))
        grader_procs, grader = spawn("grader", TaskGrader, "zorplex", ZorplexConfig())
        try:
            async def generate(prompts, sampling):
                return (await generator.generate.call_one(prompts, sampling=sampling, text=True)).completions

            results = []
            for i, sample in enumerate(samples):
                step = (lambda s: lambda conversations, last: grader.step.call_one(s, conversations, last))(sample)
                scored, failed = await converse(i, env.opening(sample), Sampling(n=1, temperature=0.0, max_tokens=24,
                                                stop=env.stop), 3, 512, tokenizer, generate, step)
                # each trajectory's turns, whole, as the replay buffer takes them from the generator
                held = [await generator.completions.call_one([t.key for t in s.completion.turns], forget=True)
                        for s in scored]
                results.append((scored, failed, held))
            return results
        finally:
            await gen_procs.stop()
            await grader_procs.stop()

    results = asyncio.run(run())
    decode = lambda ids: tokenizer.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    looked_up = 0
    for sample, (scored, failed, held) in zip(samples, results):
        assert failed == 0 and len(scored) == 1
        opening = tokenizer.encode_messages(env.opening(sample))
        for s, turns, whole in zip(scored, held, build_episodes(scored, 0, ControllerConfig(), 1.0, sequences=held)):
            assert whole.tokens[:len(opening)].tolist() == opening and not any(whole.loss_mask[:len(opening)])
            trained = [t for t, m in zip(whole.tokens, whole.loss_mask) if m]
            assert decode(trained) == "".join(decode(t.token_ids.tolist()) for t in turns)  # the model's tokens, all of them
            assert [lp for lp, m in zip(whole.behaviour_logprobs, whole.loss_mask) if m] == [
                lp for t in turns for lp in t.logprobs]
            between = [t for t, m in zip(whole.tokens[len(opening):], whole.loss_mask[len(opening):]) if not m]
            if len(turns) == 2 and turns[0].text.startswith("LOOKUP["):  # the tool's answer, in the template
                looked_up += 1
                value = sample.info["values"].get(turns[0].text.removeprefix("LOOKUP[").removesuffix("]"),
                                                  "unknown word")
                assert decode(between) == f"<|im_end|>\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n"
                assert f"tool\n{value}" in s.completion.text
            step_wise = build_episodes([s], 0, ControllerConfig(advantage="step_wise_grpo"), 1.0, sequences=[turns])
            assert [decode([t for t, m in zip(e.tokens, e.loss_mask) if m]) for e in step_wise] == [
                decode(t.token_ids.tolist()) for t in turns]
    assert looked_up >= 2  # greedy SmolLM2 looks up most words after the worked example


def test_a_grader_without_step_serves_single_turn_tasks_only():
    single = load_config("smoke", ["--grader.impl", "user_task:ScoreOnlyGrader"])
    assert actor_classes(single)["grader"].__name__ == "ScoreOnlyGrader"
    with pytest.raises(ValueError, match="user_task:ScoreOnlyGrader cannot be the grader: it has no step endpoint"):
        actor_classes(load_config("smoke", ["--grader.impl", "user_task:ScoreOnlyGrader", "--task", "zorplex"]))


TWO_REPLICAS = ["--generator.replicas", "2", "--generator.num_threads", "1", "--generator.cpus", "0;1"]


def smoke(tmp_path, *args) -> tuple[list[dict], list[dict]]:
    run = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path),
                          "--checkpoint.every", "0", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    read = lambda name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read("rollouts.jsonl")


@pytest.mark.processes
def test_step_wise_grpo_trains_a_users_environment_turn_by_turn_each_group_on_its_replica(tmp_path):
    """On two replicas with sticky routing (the default), each group's later turns ask for the replica of
    its previous turn, and vLLM's prefix-cache counts reach the step's metrics (80 tokens a turn: the third
    turn's prompt fills one of vLLM's 128-token blocks on the CPU, the unit its prefix cache keeps). That
    the cache serves later turns because of sticky routing, and not under least-loaded routing: the
    scripted conversation below."""
    metrics, rollouts = smoke(tmp_path, "--task", "user_task:FakeTool", "--controller.advantage", "step_wise_grpo",
                              "--controller.max_turns", "3", "--controller.max_policy_age", "1",
                              "--generator.max_tokens", "80", *TWO_REPLICAS)
    assert [m["step"] for m in metrics] == [1, 2]
    # every later turn asks for its group's replica: 2 groups a step and the first eval's 2 conversations,
    # 2 later turns each; most stay (a replica more than 2 calls busier than the other would move one)
    kept, moved = (sum(m[f"generator_calls_{k}"] for m in metrics) for k in ("kept", "moved"))
    assert kept + moved == 2 * 2 * 2 + 2 * 2 and kept > moved
    assert sum(m["prompt_tokens_cached"] for m in metrics) > 0 and any(m.get("prefix_cache_hit_rate") for m in metrics)
    assert_staleness_bound(metrics, rollouts, 1)
    # 2 prompts x 4 conversations x 3 turns each: one episode per turn
    assert [(m["turns_mean"], m["episodes"]) for m in metrics] == [(3.0, 24), (3.0, 24)]
    assert all(r["turns"] == 3 and "<|im_start|>tool\nresult 1<|im_end|>" in r["completion"]
               and "<|im_start|>tool\nresult 2<|im_end|>" in r["completion"] for r in rollouts)
    assert_checks_are_the_means_of_the_records(metrics, rollouts, "long")
    assert "eval_accuracy" in metrics[-1]


@pytest.mark.processes
def test_sticky_routing_serves_later_turns_from_the_prefix_cache_and_least_loaded_routing_does_not(tiny_checkpoint):
    """The same scripted conversation (the tiny model, greedy, 3 turns of 120 tokens: each turn's prompt
    holds the ones before it, past vLLM's 128-token blocks on the CPU) through the real ReplicaPool over
    two real vLLM replicas, once routed sticky and once least-loaded, the group preferring its previous
    turn's replica as rollout.run_group does; the tool's answers come from FakeTool in a real grader
    actor. Sticky keeps every turn on one replica, whose prefix cache serves the conversation so far;
    least-loaded sends turn 2 to the idle replica, which never saw the conversation (nothing cached; it
    takes turn 1 from the replica holding it, as rollout.Attempt has it do), and turn 3 back to the first,
    which holds turn 1 only. Each arm has its own opening: the replicas are
    shared, their caches are not reset, and no block of one arm's conversation is in the other's."""
    from meshrl.actors.replicas import Replica, ReplicaPool, processes
    from user_task import FakeTool

    tokenizer = ChatTokenizer(tiny_checkpoint)
    sampling = Sampling(n=1, temperature=0.0, max_tokens=120)

    async def run():
        spawned = [spawn(f"generator{i}", VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=1), WeightSyncConfig(),
                         str(tiny_checkpoint)) for i in range(2)]
        grader_procs, grader = spawn("grader", TaskGrader, "user_task:FakeTool", FakeTool.Config(turns=3))
        try:
            found = [(await processes(procs, f"generator{i}"))[0] for i, (procs, _) in enumerate(spawned)]

            async def arm(opening: str, sticky_slack: int | None) -> list[tuple[int, int, int]]:
                """(replica, prompt tokens, cached prompt tokens) of each turn, and the pool's kept and moved."""
                async def start(i: int) -> Replica:
                    return Replica(i, spawned[i][0], spawned[i][1], *found[i])

                pool = ReplicaPool("generator", start, count=2, max_restarts=0, sticky_slack=sticky_slack)
                await pool.start()
                turns, served_by, holders = [], None, {}  # holders: each turn's key -> the replica holding it

                async def generate(prompts, sampling):
                    nonlocal served_by

                    async def on(replica):
                        nonlocal served_by
                        served_by = replica
                        sent = [p if p.prefix is None or holders[p.prefix] is replica
                                else dataclasses.replace(p, prefix_holder=holders[p.prefix].actor) for p in prompts]
                        return replica, await replica.actor.generate.call_one(sent, sampling=sampling, text=True)

                    replica, answer = await pool.call(on, prefer=served_by)
                    holders.update((g.key, replica) for g in answer.completions)
                    cache = answer.report  # the requests finished since the replica's last report: this one's
                    turns.append((replica.index, cache["prompt_tokens"], cache["cached_prompt_tokens"]))
                    return answer.completions

                sample = FakeTool(FakeTool.Config()).train_sample(0)
                step = lambda conversations, last: grader.step.call_one(sample, conversations, last)  # noqa: E731
                scored, failed = await converse(0, [{"role": "user", "content": opening}], sampling, 3, 512, tokenizer,
                                                generate, step)
                assert failed == 0 and [len(s.completion.turns) for s in scored] == [3]
                return turns, (pool.kept, pool.moved)

            # the same length of opening, the first words differ: different blocks from the first one on
            sticky = await arm("Conversation one: tell me about the weather today.", 2)
            least_loaded = await arm("Conversation two: tell me about the weather today.", None)
            return sticky, least_loaded
        finally:
            for procs, _ in spawned:
                await procs.stop()
            await grader_procs.stop()

    (sticky, kept_moved), (least, plain) = asyncio.run(run())
    prompts = [t[1] for t in sticky]
    assert [t[1] for t in least] == prompts and prompts[0] + 120 < prompts[1]  # every turn 120 tokens long

    def blocks(tokens: int) -> int:
        """What vLLM's prefix cache holds of a conversation of `tokens` (its last token's KV never computed):
        whole 128-token blocks."""
        return (tokens - 1) // 128 * 128

    # sticky: every turn on one replica, whose cache serves each later turn the conversation before it
    assert len({t[0] for t in sticky}) == 1 and kept_moved == (2, 0)
    assert [t[2] for t in sticky] == [0, blocks(prompts[0] + 120), blocks(prompts[1] + 120)] == [0, 128, 256]
    # least-loaded: turns alternate over the idle replicas; turn 2 finds nothing, turn 3 turn 1's blocks only
    assert least[0][0] == least[2][0] != least[1][0] and plain == (0, 0)
    assert [t[2] for t in least] == [0, 0, blocks(prompts[0] + 120)] == [0, 0, 128]


@pytest.mark.processes
@pytest.mark.parametrize("generator_class", [VLLMGenerator, TorchGenerator])
def test_a_later_turn_sends_only_its_new_tokens_and_a_replica_that_did_not_make_the_turn_before_takes_it(
        tiny_checkpoint, generator_class):
    """Turn 2 of a conversation is sent as its new tokens only (the template's end of turn 1, the tool's
    answer, the assistant's turn opened), naming turn 1 (`Prompt.prefix`), which replica A generated and
    holds. Sent to A, A puts turn 1 in front itself; sent to B with `prefix_holder` A, B takes turn 1 from
    A. Greedy, both generate the same tokens from the same whole prompt: turn 1's prompt and tokens, then
    the new ones. The conversation stays under vLLM's 128-token blocks on the CPU: no replica's prefix
    cache serves any of it, both compute the whole prompt. The torch generator holds the contract alike."""
    tokenizer = ChatTokenizer(tiny_checkpoint)
    greedy = Sampling(n=1, temperature=0.0, max_tokens=16)
    opening = [{"role": "user", "content": "What is 2 + 3?"}]

    async def run():
        spawned = [spawn(f"generator{i}", generator_class, GeneratorConfig(weight_update="drain", num_threads=1),
                         WeightSyncConfig(), str(tiny_checkpoint)) for i in range(2)]
        (_, a), (_, b) = spawned
        try:
            [first] = (await a.generate.call_one([Prompt(0, tokenizer.encode_messages(opening))], sampling=greedy,
                                                 text=True)).completions
            new = tokenizer.continuation([*opening, {"role": "assistant", "content": first.text}], first.tail,
                                         [{"role": "tool", "content": "5"}])
            later = Prompt(0, new, prefix=first.key)
            [on_a] = (await a.generate.call_one([later], sampling=greedy)).completions
            [on_b] = (await b.generate.call_one([dataclasses.replace(later, prefix_holder=a)], sampling=greedy)).completions
            [turn1] = await a.completions.call_one([first.key], forget=True)  # still held: B only read it
            [whole_a] = await a.completions.call_one([on_a.key], forget=True)
            [whole_b] = await b.completions.call_one([on_b.key], forget=True)
            return first, turn1, new, on_a, on_b, whole_a, whole_b
        finally:
            for procs, _ in spawned:
                await procs.stop()

    first, turn1, new, on_a, on_b, whole_a, whole_b = asyncio.run(run())
    conversation = (turn1.prompt_token_ids + turn1.token_ids).tolist() + new
    assert first.prompt_tokens + first.num_tokens == len(turn1.prompt_token_ids + turn1.token_ids)
    assert len(conversation) + greedy.max_tokens < 128 and 0 < len(new) < len(conversation)
    # what each replica generated from: the whole conversation, though only `new` was sent
    assert on_a.prompt_tokens == on_b.prompt_tokens == len(conversation)
    assert whole_a.prompt_token_ids.tolist() == whole_b.prompt_token_ids.tolist() == conversation
    assert len(whole_a.token_ids) > 0 and whole_b.token_ids == whole_a.token_ids
    assert (on_b.num_tokens, on_b.policy_version) == (on_a.num_tokens, on_a.policy_version)


@pytest.mark.processes
def test_zorplex_smoke_run_on_two_replicas_serves_prompts_from_the_prefix_cache(tmp_path):
    """vLLM's own count of prompt tokens its prefix cache served, per step (the tiny model never calls the
    tool: these are the openings' shared worked example; later turns: the step-wise run above)."""
    metrics, rollouts = smoke(tmp_path, "--task", "zorplex", "--zorplex.eval_size", "2", "--zorplex.level", "2",
                              *TWO_REPLICAS)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 < m["prefix_cache_hit_rate"] < 1 and m["prompt_tokens_cached"] > 0 for m in metrics)
    assert {"tagged", "tool_call"} <= {k for r in rollouts for k in r["reward_components"]}
    assert_checks_are_the_means_of_the_records(metrics, rollouts, Zorplex.accuracy)
    assert [m["episodes"] for m in metrics] == [8, 8]  # one per trajectory by default
    assert {r["prompt"] for r in rollouts} <= {Zorplex(ZorplexConfig(level=2)).train_sample(i).prompt for i in range(4)}


def test_the_multiturn_bench_compares_the_arms_from_their_rows():
    """`meshrl bench multiturn`'s figures, recomputed by hand from two arms' rows (its runs are real
    `meshrl train` runs, whose rows the step-wise run above checks)."""
    from meshrl.tools.bench import multiturn

    def rows(gen, prefilled, cached, rates, kept):
        return [{"gen_time_s": g, "prompt_tokens_prefilled": p, "prompt_tokens_cached": c, "generator_calls_kept": k,
                 "generator_calls_moved": 0, **({"prefix_cache_hit_rate": r} if r is not None else {})}
                for g, p, c, r, k in zip(gen, prefilled, cached, rates, kept)]

    result = multiturn.compare({"config": "zorplex_smollm2", "steps": 3, "replicas": 2,
                                "least_loaded": multiturn.arm_figures(rows([4, 6, 5], [900, 800, 700], [0, 100, 200],
                                                                           [0.0, 0.1, None], [0, 0, 0])),
                                "sticky": multiturn.arm_figures(rows([3, 4, 5], [300, 300, 300], [600, 600, 600],
                                                                     [0.6, 0.7, 0.8], [4, 4, 4]))})
    assert result["least_loaded"]["gen_time_s"] == 5 and result["sticky"]["gen_time_s"] == 4  # medians
    assert result["least_loaded"]["prefix_cache_hit_rate"] == pytest.approx(0.05)  # the steps that had requests
    assert result["sticky"]["calls_kept"] == 12 and result["sticky"]["prompt_tokens_cached"] == 600
    assert result["gen_time_sticky_vs_least_loaded"] == pytest.approx(4 / 5)
    assert result["prefilled_sticky_vs_least_loaded"] == pytest.approx(300 / 800)
    text = multiturn.report(result)
    assert "sticky against least-loaded: generation 0.80 x, prefilled tokens 0.38 x" in text
    assert "prefix_cache_hit_rate" in text and "0.700" in text
