"""``python -m services.replica``: start one replica (see ``main.build_parser`` for flags)."""

import sys

from services.entrypoint import set_engine_process_settings

set_engine_process_settings()  # before the replica's imports load torch

from services.replica.main import main  # noqa: E402

sys.exit(main())
