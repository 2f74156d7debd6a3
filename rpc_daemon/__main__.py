import sys

from rpc_daemon.cli import main

sys.exit(main())
