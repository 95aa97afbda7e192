"""Measuring what the hardware and a plan's step do: the truth the cost model is checked against.

    profile.py         `autoshard profile`: microbenchmarks on the job's ranks -> a cluster file
    step.py            `autoshard measure`: a plan's real training steps, timed, beside its prediction
    comm_check.py      the bytes each collective kind moves in a step (against `cost_models/prediction.py`)
    memory.py          parameter bytes each rank holds
    reference_loop.py  the training step written by hand as torchtitan writes it, for comparison

Everything here runs on the ranks of a job (torch.distributed); the runtime it measures imports none of it.
"""

from autoshard.measure.comm_check import CollectiveRecorder, bytes_by_collective, measure_step_comm
from autoshard.measure.memory import local_param_bytes

__all__ = ["CollectiveRecorder", "bytes_by_collective", "measure_step_comm", "local_param_bytes"]
