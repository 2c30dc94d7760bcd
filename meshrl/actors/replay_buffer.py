"""The replay buffer: holds Episodes until the trainer samples them, and evicts stale ones."""

from collections import deque

from monarch.actor import Actor, endpoint

from meshrl.configs import ReplayBufferConfig
from meshrl.types import Episode


class ReplayBuffer(Actor):
    def __init__(self, config: ReplayBufferConfig):
        self.max_policy_age = config.max_policy_age
        self.episodes: deque[Episode] = deque()
        self.evicted = 0

    @endpoint
    async def add(self, episodes: list[Episode]) -> None:
        self.episodes.extend(episodes)

    @endpoint
    async def sample(self, policy_version: int, num_episodes: int) -> list[Episode] | None:
        """The oldest `num_episodes` episodes at most `max_policy_age` versions behind, or None if too few."""
        fresh = [e for e in self.episodes if policy_version - e.policy_version <= self.max_policy_age]
        self.evicted += len(self.episodes) - len(fresh)
        if len(fresh) < num_episodes:
            self.episodes = deque(fresh)
            return None
        self.episodes = deque(fresh[num_episodes:])
        return fresh[:num_episodes]

    @endpoint
    async def stats(self) -> dict[str, int]:
        return {"buffer_depth": len(self.episodes), "episodes_evicted": self.evicted}

    @endpoint
    async def state(self) -> dict:
        return {"episodes": list(self.episodes), "evicted": self.evicted}

    @endpoint
    async def load_state(self, state: dict) -> None:
        self.episodes, self.evicted = deque(state["episodes"]), state["evicted"]
