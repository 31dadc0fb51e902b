"""`python -m assistant.safety ...` runs the safety commands (see assistant/safety/cli.py)."""

import sys

from assistant.safety.cli import main

sys.exit(main())
