"""`meshrl bench multiturn`: one multi-turn workload on several generator replicas, routed least-loaded
and sticky (`generator.routing`), one run each: the seconds of generation per step, the prompt tokens
prefilled and those vLLM's prefix cache served, the hit rate, and how many later turns stayed on their
group's replica. Everything else is the same config; the comparison is within one invocation.
"""

import asyncio
import statistics
from pathlib import Path

from meshrl.configs.named import load_config
from meshrl.runtime.run import Run
from meshrl.tools.report import read_rows

ARMS = ("least_loaded", "sticky")


def arm_figures(rows: list[dict]) -> dict:
    """One arm's figures from its metric rows: medians and means per step, sums over the run."""
    rates = [r["prefix_cache_hit_rate"] for r in rows if "prefix_cache_hit_rate" in r]
    return {"steps": len(rows), "gen_time_s": statistics.median(r["gen_time_s"] for r in rows),
            "prompt_tokens_prefilled": statistics.fmean(r["prompt_tokens_prefilled"] for r in rows),
            "prompt_tokens_cached": statistics.fmean(r["prompt_tokens_cached"] for r in rows),
            "prefix_cache_hit_rate": statistics.fmean(rates) if rates else 0.0,
            "calls_kept": sum(r["generator_calls_kept"] for r in rows),
            "calls_moved": sum(r["generator_calls_moved"] for r in rows)}


def compare(result: dict) -> dict:
    """The arms' figures with sticky's against least-loaded's."""
    sticky, loaded = result["sticky"], result["least_loaded"]
    return {**result, "gen_time_sticky_vs_least_loaded": sticky["gen_time_s"] / loaded["gen_time_s"],
            "prefilled_sticky_vs_least_loaded": (sticky["prompt_tokens_prefilled"]
                                                 / max(loaded["prompt_tokens_prefilled"], 1e-9))}


def run(config_name: str, steps: int, replicas: int, run_dir: Path, overrides: list[str]) -> dict:
    result = {"config": config_name, "steps": steps, "replicas": replicas}
    for arm in ARMS:
        config = load_config(config_name, [*overrides, "--controller.steps", str(steps),
                                           "--generator.replicas", str(replicas), "--generator.routing", arm])
        asyncio.run(Run(config, run_dir / arm).run())
        result[arm] = arm_figures(read_rows(run_dir / arm))
    return compare(result)


def report(result: dict) -> str:
    lines = [f"multi-turn routing, {result['config']}, {result['steps']} steps each on {result['replicas']} replicas",
             f"  {'':26s}" + "".join(f" {arm:>14s}" for arm in ARMS)]
    for key, fmt in [("gen_time_s", ".2f"), ("prompt_tokens_prefilled", ".0f"), ("prompt_tokens_cached", ".0f"),
                     ("prefix_cache_hit_rate", ".3f"), ("calls_kept", "d"), ("calls_moved", "d")]:
        lines.append(f"  {key:26s}" + "".join(f" {result[arm][key]:>14{fmt}}" for arm in ARMS))
    lines.append(f"  sticky against least-loaded: generation {result['gen_time_sticky_vs_least_loaded']:.2f} x, "
                 f"prefilled tokens {result['prefilled_sticky_vs_least_loaded']:.2f} x")
    return "\n".join(lines)
