import sys

from coordinator.serving.cli import main

sys.exit(main())
