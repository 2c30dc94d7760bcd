"""vLLM's token-in/token-out generate endpoint, answered by a run's generator pool: for harnesses that drive
their own conversation loop (verifiers' environment servers, an agent program) while meshrl trains on the
exact tokens they were given.

`POST /inference/v1/generate` takes vLLM's own `GenerateRequest` (prompt `token_ids`, `sampling_params`)
with a session id (the `X-Session-Id` header, or a `session_id` field beside vLLM's) and answers vLLM's own
`GenerateTokensResponse`: the sampled token ids, each token's logprob (that of the distribution it was
sampled from, as the trainer scores it) and, in `weight_versions`, the policy version every token was
sampled from. `GET /v1/models` lists the one model served. Every turn is recorded under its session (its
whole prompt, tokens, logprobs and versions: the generator's `Completion`) in a `SessionStore`;
`POST /meshrl/v1/sessions/{id}/end` says the harness is done with a session, and whoever trains on them
takes the ended sessions (`SessionStore.take_ended`), each of which becomes a trainer Episode
(`Session.episode`) once the harness's reward gives it an advantage. A session's later turns go to the
replica that served its previous one while it serves (its prefix cache holds the conversation).

The server runs on the controller's event loop (uvicorn, which vLLM's own server uses), started by a run
with `serve.enabled` (meshrl/configs/serve.py) and stopped with it.
"""

import asyncio
import contextlib
import itertools
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from meshrl.actors.replicas import CallFailed, Replica, ReplicaPool, RoleFailed
from meshrl.actors.roles import TokensLost
from meshrl.actors.timeouts import Timeout, deadline
from meshrl.episodes import episode
from meshrl.types import Completion, Episode, Prompt, Sampling

GENERATE, MODELS, SESSIONS = "/inference/v1/generate", "/v1/models", "/meshrl/v1/sessions"
# vLLM sampling parameters the generator serves; any other, set to other than its default, is refused
SERVED = {"n", "temperature", "top_p", "max_tokens", "stop", "stop_token_ids", "logprobs", "detokenize",
          "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"}


class Refused(ValueError):
    """A request the server cannot serve, with the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Turn:
    completion: Completion  # the whole prompt it was generated from, its tokens, logprobs and versions
    sampling: Sampling  # as served (the temperature the trainer must score it at)

    def token_versions(self) -> list[int]:
        """The policy version each of its tokens was sampled from."""
        return token_versions(self.completion)


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    ended: bool = False
    replica: Replica | None = None  # the replica that served its last turn

    def extends(self) -> bool:
        """Whether each turn's prompt starts with the previous turn's prompt and tokens: then the whole session
        is one sequence, trained as one Episode; else each turn is a sequence of its own."""
        return all(b.completion.prompt_token_ids[:len(a.completion.prompt_token_ids) + len(a.completion.token_ids)]
                   == a.completion.prompt_token_ids + a.completion.token_ids for a, b in zip(self.turns, self.turns[1:]))

    def episode(self, advantage: float, group_id: int) -> Episode:
        """The session as a trainer Episode (meshrl/episodes.py): the last turn's sequence, trained on every
        model turn's tokens (the harness's tokens between them masked out), at the turns' temperature."""
        if not self.turns:
            raise ValueError("a session with no turns has nothing to train on")
        if not self.extends():
            raise ValueError("its turns are not one sequence (a later prompt does not start with the earlier turn): "
                             "train each turn as an Episode of its own")
        temperatures = {t.sampling.temperature for t in self.turns}
        if len(temperatures) > 1:
            raise ValueError(f"its turns were sampled at different temperatures {sorted(temperatures)}")
        return episode([t.completion for t in self.turns], advantage, group_id, temperatures.pop())


class SessionStore:
    """Every session's turns, in memory on the controller's host, until whoever trains on them takes them."""

    def __init__(self, max_sessions: int = 4096):
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}

    def open(self, session_id: str) -> Session:
        """The session `session_id`, opened if new; Refused (429) past `max_sessions`, (409) once ended."""
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                raise Refused(f"{len(self.sessions)} sessions are held (serve.max_sessions): end and take some first",
                              429)
            session = self.sessions[session_id] = Session()
        if session.ended:
            raise Refused(f"session {session_id!r} has ended: a new turn needs a new session id", 409)
        return session

    def let_go_if_empty(self, session_id: str) -> None:
        """Forget a session none of whose turns was answered (its first generation refused): no empty
        session holds a place under `max_sessions` or becomes an episode."""
        if (session := self.sessions.get(session_id)) is not None and not session.turns:
            del self.sessions[session_id]

    def end(self, session_id: str) -> Session:
        """Mark a session done (no more turns): it is taken by the next `take_ended`."""
        if session_id not in self.sessions:
            raise Refused(f"no session {session_id!r}", 404)
        self.sessions[session_id].ended = True
        return self.sessions[session_id]

    def take_ended(self) -> dict[str, Session]:
        """The ended sessions, let go here."""
        ended = {k: s for k, s in self.sessions.items() if s.ended}
        for k in ended:
            del self.sessions[k]
        return ended


def token_versions(c: Completion) -> list[int]:
    """Each token's version, from a Completion's [offset, version] changes ([]: all its first version's)."""
    changes = c.versions or [[0, c.policy_version]]
    return [version for (start, version), (end, _) in zip(changes, changes[1:] + [[len(c.token_ids), None]])
            for _ in range(start, end)]


def version_spans(c: Completion) -> list:
    """vLLM's `weight_versions` of a Completion: [start, end) of its output tokens per version."""
    from vllm.outputs import WeightVersionSpan

    changes = c.versions or [[0, c.policy_version]]
    ends = [start for start, _ in changes[1:]] + [len(c.token_ids)]
    return [WeightVersionSpan(str(version), start, end) for (start, version), end in zip(changes, ends) if end > start]


def served_sampling(request, default: Sampling, end_ids: frozenset[int] = frozenset()) -> Sampling:
    """The request's sampling parameters as the generator serves them; those left out take the run's
    generator settings (`default`). Refused for any it cannot serve. `stop_token_ids` are served when they are
    among `end_ids`, which vLLM ends a turn at by itself (a renderer names its template's end of turn); any
    `logprobs` is served as the sampled token's own logprob (no top candidates)."""
    from vllm import SamplingParams

    params, defaults = request.sampling_params, SamplingParams()
    unserved = sorted(k for k in SamplingParams.__struct_fields__ if k not in SERVED
                      and request.is_sampling_param_provided(k) and getattr(params, k) != getattr(defaults, k))
    if unserved:
        raise Refused(f"sampling_params {', '.join(unserved)} are not served (served: {', '.join(sorted(SERVED))})")
    if params.n != 1:
        raise Refused("sampling_params.n must be 1: a session is one conversation (send a request per "
                      "conversation, each with its own session id)")
    if other := sorted(set(params.stop_token_ids or ()) - end_ids):
        raise Refused(f"sampling_params.stop_token_ids {other} are not served: the generator stops only at the "
                      f"model's end tokens {sorted(end_ids)}")
    given = request.is_sampling_param_provided
    return Sampling(n=1, temperature=params.temperature if given("temperature") else default.temperature,
                    top_p=params.top_p if given("top_p") else default.top_p,
                    max_tokens=params.max_tokens if given("max_tokens") and params.max_tokens else default.max_tokens,
                    stop=list(params.stop or []))


def end_token_ids(checkpoint: Path) -> frozenset[int]:
    """The token ids vLLM ends a turn at by itself: the model's eos ids (config.json, generation_config.json)."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(checkpoint) / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def with_token_strings(answer: dict) -> dict:
    """vLLM's answer with each logprob entry also naming its token as `"token_id:N"`, the form of vLLM's
    `return_tokens_as_token_ids`, which older token-in/token-out clients read (verifiers 0.4.0's renderers
    0.1.12) where vLLM 0.32's `token_id` is not known."""
    for choice in answer["choices"]:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            entry["token"] = f"token_id:{entry['token_id']}"
    return answer


def request_model():
    """vLLM's GenerateRequest with the session id beside its fields (its other name: the X-Session-Id header)."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    class SessionGenerateRequest(GenerateRequest):
        session_id: str | None = None  # the conversation this turn belongs to

    return SessionGenerateRequest


class GenerateServer:
    def __init__(self, pool: ReplicaPool, model_name: str, default: Sampling, store: SessionStore | None = None,
                 min_version: Callable[[], int] = lambda: 0, timeout: Timeout | None = None,
                 max_model_len: int | None = None, end_ids: frozenset[int] = frozenset()):
        """Serves `pool`'s generators as `model_name`; sampling left out of a request is `default`'s; a turn's
        first token comes from version `min_version()` or newer (a run: its staleness bound); each call is
        bounded by `timeout` (the generator's, past which the replica is replaced); `end_ids`: the tokens vLLM
        ends a turn at by itself (`end_token_ids`), which a request may name as its stop_token_ids."""
        self.pool, self.model_name, self.default = pool, model_name, default
        self.store = store or SessionStore()
        self.min_version, self.timeout, self.max_model_len, self.end_ids = min_version, timeout, max_model_len, end_ids
        self.prompt_index = itertools.count()
        self.server = None
        self.task: asyncio.Task | None = None

    def app(self):
        """The FastAPI app: vLLM's request and response models on vLLM's paths."""
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList

        app = FastAPI(title="meshrl generate", openapi_url=None)
        generate_request = request_model()

        def refused(e: Refused) -> JSONResponse:
            body = ErrorResponse(error=ErrorInfo(message=str(e), type="invalid_request_error", code=e.status))
            return JSONResponse(body.model_dump(), status_code=e.status)

        @app.post(GENERATE)
        async def generate(request: generate_request, raw: Request):
            try:
                session_id = raw.headers.get("x-session-id") or request.session_id
                return JSONResponse(with_token_strings((await self.generate(request, session_id)).model_dump()))
            except Refused as e:
                return refused(e)

        @app.get(MODELS)
        async def models():
            return ModelList(data=[ModelCard(id=self.model_name, root=self.model_name, owned_by="meshrl",
                                             max_model_len=self.max_model_len)]).model_dump()

        @app.post(SESSIONS + "/{session_id}/end")
        async def end(session_id: str):
            try:
                return {"session_id": session_id, "turns": len(self.store.end(session_id).turns)}
            except Refused as e:
                return refused(e)

        return app

    async def generate(self, request, session_id: str | None):
        """One turn of session `session_id`: generated, recorded, answered as vLLM's GenerateTokensResponse."""
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (GenerateLogProbs, GenerateLogProbsContent,
                                                                           GenerateTokensChoice, GenerateTokensResponse)
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        if not session_id:
            raise Refused("no session id: send the X-Session-Id header (or a session_id field)")
        if request.stream or request.output_mode != "tokens" or request.features or request.content_parts:
            raise Refused("only token-in/token-out is served: no stream, output_mode tokens, no multimodal input")
        sampling = served_sampling(request, self.default, self.end_ids)
        session = self.store.open(session_id)
        prompt = Prompt(next(self.prompt_index), list(request.token_ids))

        async def on(replica: Replica) -> Completion:
            session.replica = replica
            async with deadline(self.timeout, "generator", f"serve {session_id}"):
                [made] = (await replica.actor.generate.call_one([prompt], sampling=sampling,
                                                                min_version=self.min_version())).completions
                [completion] = await replica.actor.completions.call_one([made.key], forget=True)
            return completion

        try:
            c = await self.pool.call(on, prefer=session.replica)
        except CallFailed as e:  # the request's own fault (too long a prompt, say): the replica serves on
            self.store.let_go_if_empty(session_id)
            raise Refused(f"the generator refused it: {e}") from None
        except (RoleFailed, TokensLost) as e:
            self.store.let_go_if_empty(session_id)
            raise Refused(f"no generator can serve it: {e}", 503) from None
        session.turns.append(Turn(c, sampling))
        return GenerateTokensResponse(
            request_id=request.request_id, model=self.model_name, created=int(time.time()),
            prompt_token_ids=c.prompt_token_ids.tolist() if request.return_token_ids else None,
            usage=UsageInfo(prompt_tokens=len(c.prompt_token_ids), completion_tokens=len(c.token_ids),
                            total_tokens=len(c.prompt_token_ids) + len(c.token_ids)),
            choices=[GenerateTokensChoice(
                index=0, finish_reason=c.finish_reason, token_ids=c.token_ids.tolist(), weight_versions=version_spans(c),
                logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=t, logprob=lp)
                                                   for t, lp in zip(c.token_ids, c.logprobs)]))])

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: any free port) on this event loop; the port it listens on."""
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the run's own handlers stop it (meshrl/actors/timeouts.py StopSignals)
                return contextlib.nullcontext()

        try:  # bound here, not by uvicorn (which exits the process when it cannot)
            sock = socket.create_server((host, port))
        except OSError as e:  # the run stops with this one line, as when a role cannot work
            raise RoleFailed(f"the generate endpoint cannot listen on {host}:{port} (serve.host, serve.port): "
                             f"{e.strerror}") from None
        self.server = Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.02)
        if self.task.done():
            self.task.result()  # its error
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self.server is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10)


async def serve_run(config, pool: ReplicaPool, timeouts, trainer_version: Callable[[], int], run_dir: Path,
                    checkpoint: Path) -> GenerateServer:
    """A run's endpoint (`serve` section) over its generator pool, turns served from within its staleness
    bound (`controller.max_policy_age` versions behind the trainer's newest at most); its address is
    written to serve.json in the run directory."""
    s, g = config.serve, config.generator
    server = GenerateServer(pool, s.model_name or config.model.source,
                            g.sampling(),
                            SessionStore(s.max_sessions),
                            lambda: max(0, trainer_version() - config.controller.max_policy_age),
                            timeouts.generate, g.max_model_len, end_token_ids(checkpoint))
    port = await server.start(s.host, s.port)
    url = f"http://{s.host}:{port}"
    (run_dir / "serve.json").write_text(json.dumps({"url": url, "generate": url + GENERATE, "models": url + MODELS,
                                                    "model": server.model_name}, indent=2))
    tqdm.write(f"serving {GENERATE} and {MODELS} at {url} (serve.json)")
    return server
