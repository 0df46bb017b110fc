"""`python -m talaria.services.gateway`: run the gateway service with settings from the environment."""

import sys

from talaria.services.gateway.gateway_service import run
from talaria.shared.runtime import main

sys.exit(main("gateway", run))
