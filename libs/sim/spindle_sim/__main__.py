"""`python -m spindle_sim [sweep | compare] ...`: the same as `spindle sim ...`."""

import sys

from .commands import main

sys.exit(main())
