"""`python -m talaria.services.instance_agent`: run the instance_agent service with settings from the environment."""

import sys

from talaria.services.instance_agent.agent_service import run
from talaria.shared.runtime import main

sys.exit(main("instance_agent", run))
