"""``python -m whitenlayers.experiment``: see :mod:`whitenlayers.experiment`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
