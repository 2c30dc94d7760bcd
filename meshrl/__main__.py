import sys

from meshrl.tools.cli import main

sys.exit(main())
