"""`meshrl study weight-sync-equivalence`: does the weight ring give vLLM exactly the weights the plain
path gives (the trainer saves a state_dict, the generator loads the file), and how much sooner?

The demo's first recipe (`sum_digits_smollm2_v1`, that of docs/studies.md's report of 2026-11-24),
synchronous, at 1 and 2 trainer ranks, three ways each: over the ring, over the plain path
(`weight_sync.transport disk`), and over the ring with `weight_sync.verify`, which loads every version
a second time from its file and compares every tensor vLLM holds (its file writes slow the publish,
so the timings come from the first two runs). Publish to served, per
version, is from the trace: the start of the trainer's publish to the end of the generator's load.
"""

import statistics
from pathlib import Path

from meshrl.actors.trace import read_spans
from meshrl.tools.studies import cell, curve_plot, read_json_lines, read_rows, table
from meshrl.tools.study import Study, StudyRun, register

STEPS = 5
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", "0", "--sum_digits.eval_size", "32",
          "--checkpoint.every", "0", "--generator.request_seeds", "true"]
RANKS = {"1rank": [], "2ranks": ["--trainer.ranks", "2", "--trainer.num_threads", "1"]}
PATHS = {"ring": [], "disk": ["--weight_sync.transport", "disk"], "verify": ["--weight_sync.verify", "true"]}
RUNS = [StudyRun(f"{path}_{ranks}", "sum_digits_smollm2_v1", COMMON + r + p)
        for ranks, r in RANKS.items() for path, p in PATHS.items()]


def publish_to_served(run_dir: Path) -> list[dict]:
    """Per version: the trainer's publish span, the generators' loads of it, and publish start to the
    last load's end (seconds)."""
    spans = read_spans(run_dir)
    publishes = {s["policy_version"]: s for s in spans if s["what"] == "publish" and "policy_version" in s}
    out = []
    for version, publish in sorted(publishes.items()):
        pulls = [s for s in spans if s["what"] == "pull" and s.get("policy_version") == version]
        if pulls:
            end = max(p["end"] for p in pulls)
            out.append({"version": version, "publish_s": publish["end"] - publish["start"],
                        "load_s": max(p["end"] - p["start"] for p in pulls), "total_s": end - publish["start"]})
    return out


def same_samples(a: Path, b: Path) -> tuple[int, int, int, float]:
    """Of the completions both runs trained at step 1 (one policy, the initial one, in both): how many,
    how many have the same text, and of those the largest difference of their summed logprobs; and
    the first step with any completion that differs (0: none differs)."""
    def by_key(run_dir: Path) -> dict:
        seen, out = {}, {}
        for r in read_json_lines(run_dir / "rollouts.jsonl"):
            key = (r["step"], r["prompt_index"])
            seen[key] = seen.get(key, -1) + 1
            out[(*key, seen[key])] = r
        return out
    ra, rb = by_key(a), by_key(b)
    first = [k for k in ra if k[0] == 1 and k in rb]
    same = [k for k in first if ra[k]["completion"] == rb[k]["completion"]]
    gap = max((abs(ra[k].get("logprob", 0) - rb[k].get("logprob", 0)) for k in same), default=float("nan"))
    differing = sorted(k[0] for k in ra if k in rb and ra[k]["completion"] != rb[k]["completion"])
    return len(first), len(same), differing[0] if differing else 0, gap


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}  # the finished runs: the others' files, if any, are partial
    compared = [r for r in RANKS if {f"ring_{r}", f"disk_{r}"} <= done]  # rank counts with both paths finished
    parts = ["## Bit identity: what vLLM holds after a ring load against a load of the same version's file\n"]
    rows = []
    for ranks in (r for r in RANKS if f"verify_{r}" in done):
        checks = read_json_lines(directory / f"verify_{ranks}" / "weights" / "verified.jsonl")
        differing = sorted({name for c in checks for name in c["differing"]})
        worst = max((d for c in checks for d in c["differing"].values()), default=0.0)
        rows.append([ranks, len(checks), sum(c["identical"] for c in checks), checks[0]["tensors"] if checks else 0,
                     ", ".join(differing[:5]) or "none", cell(worst, ".3g")])
    parts.append(table(["trainer ranks", "versions checked", "bit-identical", "tensors compared each",
                        "tensors that differed", "largest difference"], rows))

    parts.append("\n## Publish to served: ring against the plain path (seconds per version, median)\n")
    rows, curves = [], {}
    for ranks in compared:
        timings = {path: publish_to_served(directory / f"{path}_{ranks}") for path in ("ring", "disk")}
        med = {path: {k: statistics.median(t[k] for t in ts) if ts else float("nan")
                      for k in ("publish_s", "load_s", "total_s")} for path, ts in timings.items()}
        for path in ("ring", "disk"):
            rows.append([ranks, path, len(timings[path]), cell(med[path]["publish_s"]), cell(med[path]["load_s"]),
                         cell(med[path]["total_s"]),
                         cell(med["disk"]["total_s"] / med[path]["total_s"], ".2f") + " x" if path == "ring" else ""])
    for name in (run.name for run in runs):
        curves[name.replace("_", ", ")] = [(r["step"], r["reward_mean"]) for r in read_rows(directory / name)]
    parts.append(table(["trainer ranks", "path", "versions", "publish", "generator load", "publish to served",
                        "speed-up"], rows))
    parts.append("\n`publish`: the trainer's call (ring: its copy into shared memory; disk: gathering, saving the file). "
                 "`generator load`: reading and loading into vLLM. Publish to served: from the publish's start to the "
                 "end of the load.")

    parts.append("\n## The same samples? Ring against plain path, fixed seeds\n")
    rows = []
    for ranks in compared:
        total, same, first, gap = same_samples(directory / f"ring_{ranks}", directory / f"disk_{ranks}")
        rows.append([ranks, total, same, cell(gap, ".3g"), first or "none"])
    parts.append(table(["trainer ranks", "completions at step 1", "same text", "largest summed-logprob difference "
                        "among them", "first step with a different completion"], rows))
    parts.append("\nStep 1 samples from the initial weights in both runs, so it compares sampling alone; later steps "
                 "also compare training (the episodes' order in a batch follows the groups' finishing order, "
                 "so the sums that make a gradient may be added in another order).")

    curve_plot(curves, directory / "reward_curves.png", "step", "reward mean (train samples)",
               "the same run, weights by ring, plain path and ring+verify")
    parts.append("\n![reward per step](reward_curves.png)")
    return "\n".join(parts)


register(Study("weight-sync-equivalence", "Does the weight ring give vLLM the same weights as loading the trainer's "
               "state_dict from disk, the same samples and the same training, and how much sooner is a version "
               "served?", RUNS, report))
