"""Shortest time to train on a token budget under the critical-batch-size limit (Lamy-Poirier 2021).

The code is autoshard/validation/training_time.py; `python scripts/shortest_training_time.py --help` for its options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard.validation.training_time import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
