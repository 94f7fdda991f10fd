"""`python -m spmd3d` is `python -m spmd3d.train`."""

import sys

from .train import main

sys.exit(main())
