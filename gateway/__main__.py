"""``python -m conveyor.gateway``: the HTTP gateway's program (``conveyor gateway`` starts it)."""

import sys

from conveyor.gateway.cli import main

sys.exit(main())
