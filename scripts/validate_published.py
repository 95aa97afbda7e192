"""Predict every published training run and memory figure; report the errors.

The code is autoshard/validation/published.py; `python scripts/validate_published.py --help` for its options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard.validation.published import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
