"""What a plan is: the vocabulary the planner writes and the runtime reads.

    plan.py        Plan (versioned JSON), OpPlan, OpStrategy, ParamPlacement, PipelineSpec, Prediction
    layouts.py     named mesh axes (MeshSpec) and semantic tensor layouts (Layout: S(batch), S(feat), P, ...)
    strategies.py  the strategy families an operator may take (DP, ZeRO, 1D / 2D / 3D tensor parallelism)
    contract.py    what the runtime can apply: pipeline entry points, tensor-parallel limits, expert roles
    physical.py    semantic parameter placements as the tensor dims they shard
    breakdown.py   the records of a prediction: time and memory by cause

(The package is `plans`, not `plan`: `autoshard.plan` is the public planning function.)
"""
