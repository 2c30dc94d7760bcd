"""Test environments written against openenv's Environment (openenv 0.10.0), for tests/test_openenv.py: Zorplex's
lookup game as an OpenEnv environment, built from meshrl.tasks.zorplex's own samples, tool answers and reward, so
scripted replies can be checked against native Zorplex. Run as a script it serves the environment on
127.0.0.1 (`python openenv_envs.py PORT [CLASS [CAPACITY]]`), with concurrent sessions (64 at most by default).

Each observation's metadata carries the environment's checks and `open_sessions`: the instances alive in its
process when it was made (a served environment's sessions, or one grader's), to show sessions overlapping.
`ZorplexToolEnv` is the same game with MCP tools (an openenv MCPEnvironment). `ZorplexKillerEnv` kills its own process at the first step of train seed 1, once (a marker file, named by
MESHRL_TEST_KILL_MARK, remembers it): a grader dying mid-group.
"""

import os
import signal
import sys
from pathlib import Path

from fastmcp import FastMCP
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment

from meshrl.tasks.openenv import SEEDS
from meshrl.tasks.zorplex import Zorplex, ZorplexConfig

NATIVE = ZorplexConfig(example=False)  # the native task these episodes equal (its system message: openenv.system)


class ZorplexAction(Action):
    message: str  # the model's reply


class ZorplexObservation(Observation):
    text: str = ""  # the question, or the tool's answer


def zorplex_sample(seed: int):
    """The native task's sample for a seed: train prompt `seed`, or a held-out split's prompt by its seed range."""
    native = Zorplex(NATIVE)
    if seed < SEEDS["validation"]:
        return native.train_sample(seed)
    split = "test" if seed >= SEEDS["test"] else "validation"
    held_out = native.eval_samples(split)
    return held_out[(seed - SEEDS[split]) % len(held_out)]


class ZorplexLookupEnv(Environment[ZorplexAction, ZorplexObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True
    alive = 0  # instances not closed, in this process

    def __init__(self):
        super().__init__()
        ZorplexLookupEnv.alive += 1
        self.closed = False
        self.native = Zorplex(NATIVE)
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> ZorplexObservation:
        self.seed = seed or 0
        self.sample = zorplex_sample(self.seed)
        self.messages = self.native.opening(self.sample)
        self._state = State(episode_id=episode_id, step_count=0)
        return ZorplexObservation(text=self.sample.prompt, metadata={"open_sessions": ZorplexLookupEnv.alive})

    def step(self, action: ZorplexAction, timeout_s=None, **kwargs) -> ZorplexObservation:
        self._state.step_count += 1
        self.messages.append({"role": "assistant", "content": action.message})
        answer = self.native.step(self.sample, self.messages)
        alive = {"open_sessions": ZorplexLookupEnv.alive}
        if answer is None:
            reward, checks = self.native.conversation_reward(self.sample, self.messages)
            return ZorplexObservation(done=True, reward=reward, metadata={**checks, **alive})
        self.messages += answer
        return ZorplexObservation(text=answer[0]["content"], reward=0.0, metadata=alive)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            ZorplexLookupEnv.alive -= 1


class ZorplexPatientEnv(ZorplexLookupEnv):
    """A reply with neither a lookup nor an answer gets a hint instead of ending the episode: with a random model,
    conversations run to controller.max_turns (truncated)."""

    def step(self, action: ZorplexAction, timeout_s=None, **kwargs) -> ZorplexObservation:
        if "LOOKUP[" in action.message or "Answer:" in action.message:
            return super().step(action, timeout_s, **kwargs)
        self.messages += [{"role": "assistant", "content": action.message}, {"role": "tool", "content": HINT}]
        return ZorplexObservation(text=HINT, reward=0.0, metadata={"open_sessions": ZorplexLookupEnv.alive})


HINT = "Write LOOKUP[word], or Answer: N."


class ZorplexKillerEnv(ZorplexLookupEnv):
    def step(self, action: ZorplexAction, timeout_s=None, **kwargs) -> ZorplexObservation:
        mark = Path(os.environ["MESHRL_TEST_KILL_MARK"])
        if self.seed == 1 and not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action, timeout_s, **kwargs)


class QuestionObservation(Observation):
    text: str = ""


class ZorplexToolEnv(MCPEnvironment):
    """Zorplex with MCP tools: `lookup(word)` answers a word's value (a step reward of 0.1 for a word of the
    question, as Zorplex's tool_weight), `answer(value)` ends the episode, rewarded 1 if right."""

    def __init__(self):
        tools = FastMCP("zorplex")

        @tools.tool
        def lookup(word: str) -> str:
            return str(self.sample.info["values"].get(word, "unknown word"))

        @tools.tool
        def answer(value: int) -> str:
            self.answered = str(value)
            return "answered"

        super().__init__(tools)

    def reset(self, seed=None, episode_id=None, **kwargs) -> QuestionObservation:
        self.sample, self.answered = zorplex_sample(seed or 0), None
        return QuestionObservation(text=self.sample.prompt)

    async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:
        observation = await super().step_async(action, timeout_s, **kwargs)
        arguments = getattr(action, "arguments", {})
        if getattr(action, "tool_name", "") == "lookup" and arguments.get("word") in self.sample.info["values"]:
            observation.reward = 0.1
        if self.answered is not None:
            observation.done, observation.reward = True, float(self.answered == self.sample.answer)
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(done=True, reward=0.0)

    @property
    def state(self) -> State:
        return State()


def app(env: type = ZorplexLookupEnv, capacity: int = 64):
    return create_app(env, ZorplexAction, ZorplexObservation, env_name="zorplex", max_concurrent_envs=capacity)


if __name__ == "__main__":
    import uvicorn

    port, env, capacity = (sys.argv[1:] + ["ZorplexLookupEnv", "64"][len(sys.argv) - 2:])[:3]
    uvicorn.run(app(globals()[env], int(capacity)), host="127.0.0.1", port=int(port), log_level="warning")
