import sys

from rpc_daemon.daemon.cli import main

sys.exit(main())
