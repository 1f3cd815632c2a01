"""``python -m services.replica``: start one replica (see ``main.build_parser`` for flags)."""

import sys

from services.replica.main import main

sys.exit(main())
