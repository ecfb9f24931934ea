"""``python -m rampart.plan``: see ``rampart.plan.planner``."""

import sys

from rampart.plan.planner import main

sys.exit(main())
