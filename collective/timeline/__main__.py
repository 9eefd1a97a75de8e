"""`python -m collective.timeline summary FILE`: see `collective.timeline.cli`."""
import sys

from .cli import main

sys.exit(main())
