"""A real actor whose endpoints only sleep and say when they ran (their own wall clock), for
tests/test_monarch_rules.py; imported by the actor processes (conftest puts tests/ on their PYTHONPATH)."""

import asyncio
import time

from monarch.actor import Actor, concurrent_endpoint, endpoint


async def sleep_timed(seconds: float) -> tuple[float, float]:
    """Sleep `seconds`; (start, end), wall clock."""
    start = time.time()
    await asyncio.sleep(seconds)
    return start, time.time()


class Sleeper(Actor):
    @endpoint
    async def plain(self, seconds: float) -> tuple[float, float]:
        return await sleep_timed(seconds)

    @concurrent_endpoint
    async def together(self, seconds: float) -> tuple[float, float]:
        return await sleep_timed(seconds)
