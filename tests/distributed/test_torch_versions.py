"""The runtime on a torch without FSDP2's SPMD mode (torch 2.11, what GPU images shipped when 2.13 was out),
simulated on later torch: `DataParallelMeshDims` is removed from `torch.distributed.fsdp` before autoshard is
imported, in a fresh interpreter with a one-rank gloo group (on a real torch 2.11 the test runs as it is).

The runtime imports; a data-parallel plan (plain tensors, FSDP2 as torchtitan uses it) applies and trains; a
plan that needs the SPMD mode (here a tensor-parallel one with a dp axis) is refused with `RuntimeSetupError`
naming the torch to install, before the model is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed]

HERE = Path(__file__).parent

_SCRIPT = r"""
import json, sys, tempfile
import torch.distributed.fsdp as fsdp
if hasattr(fsdp, "DataParallelMeshDims"):
    del fsdp.DataParallelMeshDims  # torch 2.11 has none: no SPMD mode
import torch, torch.distributed as dist
import autoshard.runtime  # must import
from autoshard.capture import capture
from autoshard.errors import RuntimeSetupError
from autoshard.plans.layouts import MeshSpec
from autoshard.runtime import apply_plan, build_device_mesh
from dist_models import build, example_batch
from dist_plans import make_plan

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
torch.manual_seed(0)
x, y = example_batch("llama", 2)
graph = capture(build("llama"), (x,))
out = {}
model = build("llama")
plain = make_plan(graph, MeshSpec.of(dp=1), "replicate", global_batch=2)
pm = apply_plan(model, plain, mesh=build_device_mesh(plain.mesh))
loss = torch.nn.functional.cross_entropy(pm(x).logits.flatten(0, 1), y.flatten())
loss.backward()
out["plain_loss"] = loss.item()
out["plain_grads"] = all(p.grad is not None for p in pm.parameters())
model = build("llama")
tp = make_plan(graph, MeshSpec.of(dp=1, tp=1), "megatron", global_batch=2)
before = {n: type(p).__name__ for n, p in model.named_parameters()}
try:
    apply_plan(model, tp, mesh=build_device_mesh(tp.mesh))
    out["tp_error"] = None
except RuntimeSetupError as exc:
    out["tp_error"] = str(exc)
out["untouched"] = before == {n: type(p).__name__ for n, p in model.named_parameters()}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_on_torch_without_fsdp_spmd_mode_dp_plans_run_and_tensor_parallel_plans_name_the_torch_to_install():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain_grads"] and out["plain_loss"] > 0
    assert out["tp_error"] is not None and "torch>=2.12" in out["tp_error"]
    assert out["untouched"]
