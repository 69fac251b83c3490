"""`python -m cluster.testbed up|down|status|serve-config|stop-host` (the testbed hosts' `ray`
wrapper runs `stop-host`)."""

import sys

from cluster.testbed.cli import main

if __name__ == "__main__":
    sys.exit(main())
