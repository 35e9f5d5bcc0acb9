"""`python -m glm5.finetune ...` and `torchrun --nproc_per_node N -m glm5.finetune ... --parallel.*`."""

import sys

from .launch import main

sys.exit(main())
