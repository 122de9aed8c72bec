"""``python -m conveyor.gateway.dashboard`` (``conveyor dashboard``): the operator's dashboard without
the HTTP API, for a deployment that has no gateway. The gateway's flags; default port 8001."""

import sys

from conveyor.gateway.cli import main

if __name__ == "__main__":
    sys.exit(main(program="dashboard"))
