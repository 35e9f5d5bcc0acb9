"""`python -m glm5.train ...` and `torchrun --nproc_per_node N -m glm5.train ...`."""

import sys

from .launch import main

sys.exit(main())
