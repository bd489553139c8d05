"""``python -m funshard train ...``: see :mod:`funshard.demo`."""

import sys

from funshard.demo import main

if __name__ == "__main__":
    sys.exit(main())
