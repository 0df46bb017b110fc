"""`python -m services.router`: run the router service with settings from the environment."""

import sys

from services.router.service import run
from shared.runtime import main

sys.exit(main("router", run))
