"""Allow `python -m inspector`."""

import sys

from inspector.cli import main

sys.exit(main())
