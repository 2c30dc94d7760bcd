"""`python -m meshrl`: the command line (meshrl/tools/cli.py's main). A command that fails ends the process at
once after its last line: the interpreter's teardown would otherwise print after it (native bindings' reports
of objects still alive, such as nanobind's "leaked ..." lines), and a run's files are closed by then."""

import logging
import os
import sys

from meshrl.tools.cli import main


def entry() -> None:
    """Run the command; exit with its code, without the interpreter's teardown when it failed."""
    code = main()
    if code:
        logging.shutdown()  # the log handlers flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
