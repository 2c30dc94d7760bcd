import sys

from meshrl.cli import main

sys.exit(main())
