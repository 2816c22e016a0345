"""``python -m verl_npu_autopatch``: the command-line interface."""

import sys

from verl_npu_autopatch.cli.main import main

sys.exit(main())
