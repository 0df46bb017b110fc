"""`python -m talaria.services.telemetry`: run the telemetry service with settings from the environment."""

import sys

from talaria.services.telemetry.telemetry_service import run
from talaria.shared.runtime import main

sys.exit(main("telemetry", run))
