"""The truth loop on one GPU in one command (autoshard/validation/gpu_check.py): profile, measure the committed
single-GPU plans, time the hand-written torchtitan-style loop; report in benchmarks/gpu_validation.md.

    PYTHONPATH=. python scripts/gpu_check.py            # on a machine with one GPU (writes to $OUT if set)
    python scripts/gpu_check.py --cpu                   # the same on one CPU rank, tiny models (CI)
    python scripts/gpu_check.py --make-plans            # regenerate benchmarks/gpu_plans/ (needs the planner)
    python scripts/gpu_check.py --reprice benchmarks/gpu_validation.json   # its measurements, priced again
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard.validation.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
