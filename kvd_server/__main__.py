"""`python -m kvd_server` is the `kvd` command."""

import sys

from kvd_server.cli.main import main

sys.exit(main())
