"""`python -m services.gateway`: run the gateway service with settings from the environment."""

import sys

from services.gateway.service import run
from shared.runtime import main

sys.exit(main("gateway", run))
