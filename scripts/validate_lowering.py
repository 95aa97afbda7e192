"""Predicted against measured speedups of compiled blocks, float8 and async TP (autoshard/validation/lowering.py);
writes benchmarks/lowering_validation.md and .json.

    python scripts/validate_lowering.py
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard.validation.lowering import markdown, run_checks  # noqa: E402

if __name__ == "__main__":
    rows = run_checks()
    text = markdown(rows)
    print(text)
    (ROOT / "benchmarks" / "lowering_validation.md").write_text(text)
    (ROOT / "benchmarks" / "lowering_validation.json").write_text(json.dumps(rows, indent=1) + "\n")
