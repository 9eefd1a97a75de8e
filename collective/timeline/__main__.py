"""`python -m collective.timeline summary FILE`: see `collective.timeline.cli`."""
import sys

from .cli import main

if __name__ == "__main__":  # importing this module (e.g. to list the package) runs nothing
    sys.exit(main())
