"""`python -m kernels.cpu`: build the CPU kernels now (make install does); exit 1 where they cannot be."""
import logging

from kernels.cpu import compiled

logging.basicConfig(level=logging.INFO)
raise SystemExit(0 if compiled() else 1)
