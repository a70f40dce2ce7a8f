"""`python -m pipeplan` (and `torchrun -m pipeplan run PLAN`)."""
import sys

from .cli import main

sys.exit(main())
