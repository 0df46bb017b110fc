"""`python -m talaria.services.instance_agent`: run the instance_agent service with settings from the environment."""

import sys

from talaria.services.instance_agent.agent_service import run
from talaria.shared.runtime import main

# Guarded: engines that start processes with `spawn` (vLLM) re-import the main module.
if __name__ == "__main__":
    sys.exit(main("instance_agent", run))
