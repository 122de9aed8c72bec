"""``python -m gateway.dashboard`` (``conveyor dashboard``): the operator's dashboard without
the HTTP API, for a deployment that has no gateway. The gateway's flags; default port 8001."""

import os
import sys

from gateway.cli import main

if __name__ == "__main__":
    os.environ.setdefault("CONVEYOR_GATEWAY_PORT", "8001")
    sys.exit(main(program="dashboard"))
