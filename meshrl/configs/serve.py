"""The `serve` section: the token-in/token-out generate endpoint a run may serve on the controller's host
(meshrl/runtime/serve.py), for harnesses that drive their own conversation loop. Off by default."""

from dataclasses import dataclass


@dataclass
class ServeConfig:
    """vLLM's `/inference/v1/generate` (and `/v1/models`) answered by the run's generator pool, keyed by a
    session id, every turn recorded with its token ids, logprobs and per-token policy versions."""

    enabled: bool = False  # serve the endpoint while the run trains
    host: str = "127.0.0.1"  # the address to listen on (0.0.0.0: harnesses on other hosts too)
    port: int = 8100  # the port to listen on; 0: any free port (serve.json in the run directory says which)
    model_name: str = ""  # the model id /v1/models lists and answers carry; "": model.source
    max_sessions: int = 4096  # sessions held at once (open or ended and not yet taken); a new one past it is refused (429)

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"serve.port must be between 0 and 65535, not {self.port}")
        if self.max_sessions < 1:
            raise ValueError(f"serve.max_sessions must be at least 1, not {self.max_sessions}")
