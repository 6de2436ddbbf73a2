"""`make llama-cpp`: build (or find) llama.cpp's programs and converter, and say where the programs are."""

import logging
import sys

from speculators_train.engines.llamacpp.build import ensure_built
from speculators_train.engines.llamacpp.converter import ensure_converter
from speculators_train.errors import UserError

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    ensure_converter()
    print(ensure_built())
except UserError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
