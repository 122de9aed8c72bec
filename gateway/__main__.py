"""``python -m gateway``: the HTTP gateway's program (``conveyor gateway`` starts it)."""

import sys

from gateway.cli import main

sys.exit(main())
