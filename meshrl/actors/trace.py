"""A timeline of every actor call the controller makes, to see whether generation and training
overlap and which role a step waits for.

Each call is a span: role, replica, what (generate, grade, train, publish, pull, evaluate, ...),
start and end (seconds since the run started) and the policy version it concerns. Spans stream to
`trace.jsonl`; at the end they are also written as a Chrome/Perfetto trace (`trace.json`, open it
at ui.perfetto.dev) and drawn as `timeline.png`, one lane per actor.

A span's `clock` says whose times it holds. The controller's ("controller") are when it asked and
when the answer came, which is when the actor worked only if nothing queued in between. The trainer
times its own work (`ActorClock`: each endpoint's start and end on the actor, a publish's copy from
its start to the moment it is readable) and the controller adds those spans ("actor") after each
step, so the timeline shows what really overlapped on the trainer; the controller's trainer spans
are drawn in a lane of their own beside them ("trainer 0 asked"). A generator's loads are
actor-timed too.

An actor that serves one call at a time (a grader, stepping an environment) is sent one call at a time
too, under a lock its replica owns (a replacement has a fresh one): a span then covers the actor's own
work, not time spent queued behind another call. A single-turn group's grading is its generator's call to
the grader: a "grade" span on that generator's lane, as the generator timed it (queued at the grader
included). A generator batches its calls (continuous batching): its `generate` spans
overlap. A span also bounds its calls by their role's timeout (meshrl/actors/timeouts.py): a call that does
not answer in time raises CallTimeout instead of hanging the run.
"""

import asyncio
import json
import time
from contextlib import asynccontextmanager, contextmanager, nullcontext
from pathlib import Path

from meshrl.actors.timeouts import Timeout, deadline

_NO_LOCK = nullcontext()  # an async context manager too
ACTOR_TIMED = {"trainer", "replay_buffer"}  # roles whose actors report their own spans: the controller's go to an "asked" lane


class Tracer:
    def __init__(self, run_dir: Path, resume: bool = False):
        """`resume`: go on with the spans already in trace.jsonl, the clock starting where they end."""
        self.run_dir = run_dir
        path = run_dir / "trace.jsonl"
        self.spans: list[dict] = read_spans(run_dir) if resume and path.is_file() else []
        self.file = open(path, "w")
        self.file.writelines(json.dumps(span) + "\n" for span in self.spans)
        self.origin = time.perf_counter() - max((s["end"] for s in self.spans), default=0.0)

    @asynccontextmanager
    async def span(self, role: str, what: str, policy_version: int | None = None, replica: int = 0,
                   timeout: Timeout | None = None, lock: asyncio.Lock | None = None):
        """Times the calls made inside and bounds them by `timeout`, once `lock` (if any) is held;
        yields the span, whose `policy_version` the caller may set once the call has told it (a pull
        learns its version from the call's result). A call that times out ends its span too."""
        async with lock or _NO_LOCK, self._span(role, what, policy_version, replica) as span, \
                deadline(timeout, role, what):
            yield span

    @asynccontextmanager
    async def _span(self, role: str, what: str, policy_version: int | None, replica: int):
        span = {"role": role, "replica": replica, "what": what, "start": self.now(), "end": None,
                "policy_version": policy_version, "clock": "controller"}
        try:
            yield span
        finally:
            span["end"] = self.now()
            self.spans.append(span)
            self.file.write(json.dumps(span) + "\n")

    def add(self, role: str, what: str, start: float, end: float, replica: int = 0,
            policy_version: int | None = None) -> None:
        """A span an actor timed itself, in wall-clock seconds (`time.time()` where it ran)."""
        shift = self.now() - time.time()
        span = {"role": role, "replica": replica, "what": what, "start": start + shift, "end": end + shift,
                "policy_version": policy_version, "clock": "actor"}
        self.spans.append(span)
        self.file.write(json.dumps(span) + "\n")

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.origin

    def close(self, plot: bool = True) -> None:
        """Flush trace.jsonl and write trace.json and (with `plot`) timeline.png from the spans."""
        self.file.close()
        (self.run_dir / "trace.json").write_text(json.dumps(chrome_trace(self.spans)))
        if self.spans and plot:
            plot_timeline(self.spans, self.run_dir / "timeline.png")


@asynccontextmanager
async def no_span(role: str, what: str, policy_version: int | None = None, replica: int = 0,
                  timeout: Timeout | None = None, lock: asyncio.Lock | None = None):
    """Tracer.span's stand-in where nothing is traced (the lock and the timeout still hold)."""
    async with lock or _NO_LOCK, deadline(timeout, role, what):
        yield {}


class ActorClock:
    """The spans an actor times itself (wall clock), kept until the controller takes them."""

    def __init__(self):
        self.spans: list[dict] = []

    @contextmanager
    def span(self, what: str, policy_version: int | None = None):
        start = time.time()
        try:
            yield
        finally:
            self.add(what, start, time.time(), policy_version)

    def add(self, what: str, start: float, end: float, policy_version: int | None = None) -> None:
        self.spans.append({"what": what, "start": start, "end": end, "policy_version": policy_version})

    def take(self) -> list[dict]:
        """The spans since the last take."""
        spans, self.spans = self.spans, []
        return spans


def lane(span: dict) -> str:
    asked = span["role"] in ACTOR_TIMED and span.get("clock", "controller") == "controller"
    return f"{span['role']} {span['replica']}" + (" asked" if asked else "")


def chrome_trace(spans: list[dict]) -> dict:
    """The spans as Chrome trace events ("X": complete events, microseconds), one thread per actor."""
    lanes = sorted({lane(s) for s in spans})
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": name}}
              for i, name in enumerate(lanes)]
    events += [{"ph": "X", "name": s["what"], "cat": s["role"], "pid": 1, "tid": lanes.index(lane(s)),
                "ts": s["start"] * 1e6, "dur": (s["end"] - s["start"]) * 1e6,
                "args": {"policy_version": s["policy_version"]}} for s in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def read_spans(run_dir: Path) -> list[dict]:
    """The spans of trace.jsonl (without a last line cut short by a killed run)."""
    lines = (run_dir / "trace.jsonl").read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


COLOURS = {"generate": "#1f77b4", "evaluate": "#17becf", "pull": "#ff7f0e", "grade": "#2ca02c",
           "train": "#d62728", "optim_step": "#ff9896", "pi_old": "#e377c2", "logprobs": "#e377c2", "reference": "#8c564b",
           "publish": "#9467bd", "save_state": "#7f7f7f"}


def plot_timeline(spans: list[dict], path: Path, title: str = "") -> None:
    """One lane per actor, time on the x axis, one colour per kind of call; a publish in the lower half of
    its lane, over the calls it overlaps on the trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted({lane(s) for s in spans}, key=lambda name: ("generator grader reference trainer"
                                                                .find(name.split()[0]), name))
    kinds = sorted({s["what"] for s in spans}, key=lambda what: (what == "publish", what not in COLOURS,
                                                                  list(COLOURS).index(what) if what in COLOURS else 0,
                                                                  what))
    colours = {what: COLOURS.get(what, "#b0b0b0") for what in kinds}  # bookkeeping calls in grey
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.2))
    for row, name in enumerate(lanes):
        for what in kinds:
            bars = [(s["start"], s["end"] - s["start"]) for s in spans if lane(s) == name and s["what"] == what]
            if bars:
                ax.broken_barh(bars, (row, 0.4) if what == "publish" else (row - 0.4, 0.8), color=colours[what],
                               label=what if what not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.set_title(title or "actor calls")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
