"""Regenerate the plan-quality golden file: predicted tokens/s of the plan for each (model, cluster) case.

    python scripts/update_golden.py            # rewrite tests/data/golden_plans.json
    python scripts/update_golden.py --check    # only print the differences

tests/test_plan_quality.py fails when a change makes any case more than 1% worse than this file, or when a
plan loses to one of its baselines. Review the diff of the golden file in the commit that changes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: references/, benchmarks/, tests/data/
GOLDEN = ROOT / "tests" / "data" / "golden_plans.json"

# (model, cluster, global batch, sequence length or None for the model's): 1 node to 128 nodes; A100, H100 and
# V100; a 131,072-token Llama 3 8B, where only context parallelism fits (issue 16).
CASES = [
    ("gpt2", "1x8xV100-32GB", 64, None),
    ("gpt2-xl", "1x8xA100-80GB", 128, None),
    ("bert-large", "2x8xA100-80GB", 256, None),
    ("gpt-7.5b", "4x8xV100-32GB", 256, None),
    ("llama3-8b", "2x8xH100-80GB", 256, None),
    ("llama3-70b", "8x8xH100-80GB", 512, None),
    ("gpt3-175b", "16x8xA100-80GB", 256, None),
    ("gpt3-175b", "128x8xA100-80GB", 1536, None),
    ("llama3-8b", "8x8xH100-80GB", 64, 131072),
    ("mixtral-8x7b", "4x8xH100-80GB", 128, 4096),
]


def case_key(model: str, cluster: str, batch: int, seq: int | None = None) -> str:
    return f"{model}|{cluster}|{batch}" + (f"|seq{seq}" if seq else "")


def run_case(model: str, cluster: str, batch: int, seq: int | None = None) -> dict:
    from autoshard.api import plan_with_baselines

    t0 = time.perf_counter()
    p, _, baselines, _, _ = plan_with_baselines(model, cluster, global_batch=batch, seq=seq)
    return {"tokens_per_s": p.prediction.tokens_per_s, "mfu": round(p.prediction.mfu, 4), "mesh": str(p.mesh), "ep": p.ep,
            "micro_batch": p.micro_batch,
            "recompute": p.recompute, "schedule": p.pipeline.schedule if p.pipeline.degree > 1 else None,
            "baselines": {k: (b.prediction.tokens_per_s if b.prediction else None) for k, b in baselines.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print changes, do not write")
    args = ap.parse_args(argv)
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    new = {}
    for model, cluster, batch, seq in CASES:
        key = case_key(model, cluster, batch, seq)
        new[key] = run_case(model, cluster, batch, seq)
        before = old.get(key, {}).get("tokens_per_s")
        change = f"{100 * (new[key]['tokens_per_s'] / before - 1):+.2f}%" if before else "new"
        print(f"{key:45s} {new[key]['tokens_per_s']:14,.0f} tokens/s ({change}) MFU {100 * new[key]['mfu']:.1f}% "
              f"{new[key]['mesh']}")
    if not args.check:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
