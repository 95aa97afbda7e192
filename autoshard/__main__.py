"""`python -m autoshard ...` (and `torchrun --nproc-per-node N -m autoshard measure plan.json`)."""

import sys

from autoshard.cli import main

sys.exit(main())
