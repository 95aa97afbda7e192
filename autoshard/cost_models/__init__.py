"""Everything that prices: pure functions of an operator graph, a plan's choices and a cluster's profiles.

    compute.py, comm.py, memory.py, overlap.py, host.py     kernels, collectives, bytes, overlap, the host
    zero_impl.py, context_parallel.py, expert_parallel.py   ZeRO implementations, CP and EP traffic
    context.py     PlanContext: one configuration (mesh, micro-batch, recompute, cluster) being priced
    opcost.py      one operator under one strategy, one edge under one redistribution
    template.py    the graph with repeated blocks folded, per pipeline stage
    evaluate.py    a whole assignment: schedules, overlap, memory peak -> the Prediction every command reports
    bounds.py      cheap lower bounds on time and memory
    prediction.py  what a plan issues (bytes per collective, parameter bytes), for the runtime's checks
    reprice.py     a plan file priced again on a graph and a cluster

Nothing here imports torch.distributed or the search (planner/).
"""
