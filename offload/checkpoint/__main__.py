"""``python -m offload.checkpoint consolidate SAVE_DIR OUTPUT_DIR [...]``: see offload/checkpoint/__init__.py."""

import sys

from offload.checkpoint import main

sys.exit(main())
