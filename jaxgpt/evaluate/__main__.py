"""python -m jaxgpt.evaluate (jaxgpt/evaluate/cli.py)."""

import sys

from jaxgpt.evaluate.cli import main

sys.exit(main())
