import sys

from kvpool.tools.cluster import die_with_launcher

die_with_launcher()   # first: a child of a LocalCluster ends with it, whatever happens next

from kvpool.tools.cli import main

sys.exit(main())
