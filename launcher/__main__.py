"""`python -m launcher ...` is `hvdrun ...`."""
import sys

from launcher.cli import main

sys.exit(main())
