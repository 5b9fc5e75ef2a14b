import sys

from kvpool.tools.cli import main

sys.exit(main())
