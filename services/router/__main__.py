"""`python -m talaria.services.router`: run the router service with settings from the environment."""

import sys

from talaria.services.router.router_service import run
from talaria.shared.runtime import main

sys.exit(main("router", run))
