"""The token-in/token-out generate endpoint (meshrl/runtime/serve.py) driven by a scripted client over plain
HTTP, as an external harness drives it: real generator actors (vLLM, tiny model) and a real trainer whose
published version the second turn is sampled from."""

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from actor_helpers import forward_backward, replay_buffer_on

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.replicas import ReplicaPool, monarch_replicas
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.model import ChatTokenizer
from meshrl.runtime.serve import GENERATE, MODELS, SESSIONS, GenerateServer, end_token_ids, token_versions
from meshrl.types import Sampling
from meshrl.weight_sync import WeightSyncConfig


def per_token(spans: list[dict]) -> list[int]:
    """vLLM's weight_versions spans as the version of each output token."""
    return [int(s["version"]) for s in spans for _ in range(s["start"], s["end"])]


@pytest.mark.processes
def test_a_scripted_client_runs_a_two_turn_session_recorded_with_its_exact_tokens_logprobs_and_versions(
        tiny_checkpoint):
    """Turn 1 from version 0; the trainer trains on the session's record and publishes version 1; turn 2,
    whose prompt is turn 1's prompt and reply and the harness's next tokens, comes from version 1. What the
    client was answered (token ids, logprobs, per-token versions) is what the session records, and the
    ended session is one Episode trained on both replies."""
    tokenizer = ChatTokenizer(tiny_checkpoint)
    answers, refusals = [], {}

    async def run():
        sync = WeightSyncConfig()
        pool = ReplicaPool("generator", monarch_replicas(
            lambda i: "generator", VLLMGenerator,
            lambda i: (GeneratorConfig(weight_update="drain", num_threads=1), sync, str(tiny_checkpoint))), 1, 0)
        trn_procs, trainer = spawn("trainer", TitanTrainer, TrainerConfig(lr=1e-2, num_threads=1), sync,
                                   str(tiny_checkpoint))
        buffer = replay_buffer_on(trn_procs)
        await pool.start()
        server = None
        try:
            await pool.replicas[0].actor.attach_weights.call_one([await trainer.weight_ring.call_one()])
            published = [0]
            server = GenerateServer(pool, "tiny", Sampling(temperature=1.0, max_tokens=8),
                                    min_version=lambda: published[0], max_model_len=512,
                                    end_ids=end_token_ids(tiny_checkpoint))
            port = await server.start("127.0.0.1", 0)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
                models = (await client.get(MODELS)).json()
                assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 512)]

                async def turn(token_ids, **sampling):
                    r = await client.post(GENERATE, headers={"X-Session-Id": "s1"},
                                          json={"token_ids": token_ids, "sampling_params": sampling})
                    assert r.status_code == 200, r.text
                    answers.append(r.json())
                    return r.json()["choices"][0]["token_ids"]

                first = tokenizer.encode_chat("What is 1 + 2?")
                # as verifiers' renderers ask: the template's end of turn as stop_token_ids, logprobs 1
                reply = await turn(first, temperature=1.0, max_tokens=6, logprobs=1,
                                   stop_token_ids=sorted(end_token_ids(tiny_checkpoint)))
                # the trainer takes the session's record so far and publishes version 1
                e = server.store.sessions["s1"].episode(advantage=-1.0, group_id=0)
                await forward_backward(trainer, buffer, [e])
                await trainer.optim_step.call_one()
                published[0] = await trainer.publish_weights.call_one()
                # the harness's next turn: the conversation so far, then its own tokens
                harness = tokenizer.continuation([{"role": "user", "content": "What is 1 + 2?"},
                                                  {"role": "assistant", "content": ""}], reply,
                                                 [{"role": "user", "content": "Now add 4."}])
                await turn(first + reply + harness, max_tokens=5)
                # what a harness gets wrong is refused with one line, and nothing is recorded
                for name, body, headers in [
                        ("no_session", {"token_ids": first, "sampling_params": {}}, {}),
                        ("unserved", {"token_ids": first, "sampling_params": {"top_k": 5}}, {"X-Session-Id": "s2"}),
                        ("n", {"token_ids": first, "sampling_params": {"n": 2}}, {"X-Session-Id": "s2"}),
                        ("stop_ids", {"token_ids": first, "sampling_params": {"stop_token_ids": [5]}},
                         {"X-Session-Id": "s2"})]:
                    r = await client.post(GENERATE, json=body, headers=headers)
                    refusals[name] = (r.status_code, r.json()["error"]["message"])
                ended = await client.post(f"{SESSIONS}/s1/end")
                assert ended.json() == {"session_id": "s1", "turns": 2}
                again = await client.post(GENERATE, headers={"X-Session-Id": "s1"},
                                          json={"token_ids": first, "sampling_params": {}})
                refusals["ended"] = (again.status_code, again.json()["error"]["message"])
            assert list(server.store.sessions) == ["s1"]  # refused requests opened no session
            return first, harness, server.store.take_ended()
        finally:
            if server:
                await server.stop()
            await pool.stop()
            await trn_procs.stop()

    first, harness, ended = asyncio.run(run())
    assert list(ended) == ["s1"]
    session = ended["s1"]
    assert len(session.turns) == 2 and len(answers) == 2
    for answer, turn in zip(answers, session.turns):
        [choice] = answer["choices"]
        c = turn.completion
        assert choice["token_ids"] == c.token_ids.tolist() and len(c.token_ids) > 0
        assert [x["token_id"] for x in choice["logprobs"]["content"]] == c.token_ids.tolist()
        # and in the form older token-in/token-out clients read (verifiers 0.4.0's renderers)
        assert [x["token"] for x in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in c.token_ids]
        assert [x["logprob"] for x in choice["logprobs"]["content"]] == c.logprobs.tolist()
        assert per_token(choice["weight_versions"]) == turn.token_versions() == token_versions(c)
        assert answer["usage"]["prompt_tokens"] == len(c.prompt_token_ids)
    one, two = (t.completion for t in session.turns)
    assert one.prompt_token_ids.tolist() == first
    assert two.prompt_token_ids.tolist() == (one.prompt_token_ids + one.token_ids).tolist() + harness  # token ids exactly
    assert set(session.turns[0].token_versions()) == {0} and set(session.turns[1].token_versions()) == {1}
    assert len(one.token_ids) <= 6 and len(two.token_ids) <= 5  # each turn's own max_tokens
    # one Episode: the second turn's sequence, trained on both replies and not on the harness's tokens
    e = session.episode(advantage=1.0, group_id=3)
    assert e.tokens == two.prompt_token_ids + two.token_ids
    trained = [t for t, m in zip(e.tokens, e.loss_mask) if m]
    assert trained == (one.token_ids + two.token_ids).tolist() and e.policy_version == 0
    assert refusals["no_session"][0] == 400 and "X-Session-Id" in refusals["no_session"][1]
    assert refusals["unserved"][0] == 400 and "top_k" in refusals["unserved"][1]
    assert refusals["n"][0] == 400 and "n must be 1" in refusals["n"][1]
    assert refusals["stop_ids"][0] == 400 and "[5]" in refusals["stop_ids"][1]
    assert refusals["ended"][0] == 409


@pytest.mark.processes
def test_a_training_run_with_serve_enabled_serves_while_it_trains_and_stops_serving_with_it(tmp_path):
    """`meshrl train --serve.enabled true --serve.port 0`: serve.json names the address, a harness's turn is
    answered while the run trains, the run ends as usual, and nothing listens there afterwards."""
    run = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path),
                            "--controller.steps", "4", "--serve.enabled", "true", "--serve.port", "0"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "serve.json").is_file():
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "serve.json never appeared"
            time.sleep(0.1)
        served = json.loads((tmp_path / "serve.json").read_text())
        assert served["model"] == "tiny" and served["generate"] == served["url"] + GENERATE
        answer = httpx.post(served["generate"], headers={"X-Session-Id": "h1"}, timeout=120,
                            json={"token_ids": [1, 9690, 198, 2683], "sampling_params": {"max_tokens": 4}})
        assert answer.status_code == 200, answer.text
        [choice] = answer.json()["choices"]
        assert len(choice["token_ids"]) == 4 and len(per_token(choice["weight_versions"])) == 4
        _, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4
    with pytest.raises(httpx.ConnectError):
        httpx.get(served["url"] + MODELS, timeout=5)


def test_a_session_whose_first_turn_was_refused_holds_no_place():
    """A session opened for a turn the generator then refused is let go (found in review: it held a place
    under serve.max_sessions and raised when made an episode); one with an answered turn is kept."""
    from meshrl.runtime.serve import Refused, Session, SessionStore

    store = SessionStore(max_sessions=1)
    store.open("refused")
    store.let_go_if_empty("refused")
    answered = store.open("answered")  # the place is free again
    answered.turns.append(object())
    store.let_go_if_empty("answered")
    assert list(store.sessions) == ["answered"] and isinstance(store.sessions["answered"], Session)
    with pytest.raises(Refused, match="serve.max_sessions"):
        store.open("third")
