"""python -m jaxgpt.hf (jaxgpt/hf/cli.py)."""

import sys

from jaxgpt.hf.cli import main

sys.exit(main())
