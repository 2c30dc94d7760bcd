"""`dataset.reward math`: a reply's final answer compared with the reference by Hugging Face's
math-verify (LaTeX, fractions, sets, intervals, equations such as x=3 against 3), with a hard time limit.

math-verify hands answers to sympy, and a reply such as \\boxed{9^{9^{9^{9}}}} keeps sympy busy for as
long as it is allowed. Its own time limit uses SIGALRM, which works only in a process's main thread
(a grader actor's endpoints run in another) and cannot stop code that does not return to Python. So
the comparison runs in a child process of the grader's, which is killed when a reply takes longer than
`TIMEOUT_S` (the reply scores 0) and started again for the next one.

math-verify itself returns "no answer" for what it cannot read; an exception out of it is a fault, and
counts as a user's reward raising would: the child answers its error and the parent raises it, so the
grader leaves the reply out and counts it (`reward_errors`).
"""

import json
import logging
import os
import select
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

TIMEOUT_S = 5.0


def compare(text: str, answer: str) -> dict[str, bool]:
    """{"found": the reply has an answer math-verify can read, "correct": it equals the reference}.
    A reference written in LaTeX without $ delimiters is read as if it had them."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
    given = parse(text, parsing_timeout=None)
    return {"found": bool(given), "correct": bool(given and gold and verify(gold, given, timeout_seconds=None))}


class MathVerifier:
    """`compare` in a child process, with a time limit per reply; one per grader, used by one thread
    at a time."""

    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self.child: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def __call__(self, text: str, answer: str) -> dict[str, bool] | None:
        """The comparison, or None if it ran past the time limit (the child is then killed). RuntimeError
        if math-verify raised on it."""
        with self.lock:
            child = self._started()
            child.stdin.write(json.dumps([text, answer]) + "\n")
            child.stdin.flush()
            if not select.select([child.stdout], [], [], self.timeout_s)[0]:
                logger.warning("math-verify ran past %.1f s on a reply (scored 0): %.200r", self.timeout_s, text)
                self.close()
                return None
            line = child.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError("the math-verify child process died on a reply")
            result = json.loads(line)
            if "error" in result:
                raise RuntimeError(f"math-verify raised on a reply: {result['error']}")
            return result

    def _started(self) -> subprocess.Popen:
        if self.child is None or self.child.poll() is not None:
            self.child = subprocess.Popen([sys.executable, "-m", "meshrl.tasks.math_reward"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if self.child.stdout.readline().strip() != "ready":  # imported: its start is not timed
                raise RuntimeError("the math-verify child process did not start")
        return self.child

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            self.child = None


def _serve() -> None:
    """The child: a [text, answer] JSON line in, a `compare` JSON line out (or {"error": its exception}),
    until its input closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the limit is the parent's: no notice of its own
    compare("1", "1")  # math-verify and sympy imported
    print("ready", flush=True)
    for line in sys.stdin:
        text, answer = json.loads(line)
        try:
            result = compare(text, answer)
        except Exception as e:  # answered to the parent, which raises it: counted as a reward error
            result = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _serve()
