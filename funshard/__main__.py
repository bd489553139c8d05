"""``python -m funshard train ...``: see :mod:`funshard.demo`."""

import sys

from funshard.demo import main

sys.exit(main())
