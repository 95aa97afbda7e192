"""Regenerate the plan-quality golden file: predicted tokens/s of the plan for each (model, cluster) case.

The code is autoshard/validation/golden.py; `python scripts/update_golden.py --help` for its options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard.validation.golden import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
