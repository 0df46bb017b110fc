"""`python -m services.telemetry`: run the telemetry service with settings from the environment."""

import sys

from services.telemetry.service import run
from shared.runtime import main

sys.exit(main("telemetry", run))
