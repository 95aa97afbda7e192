"""No silent hangs (issue 7): when one rank fails inside `train_step`, every other rank fails too, within the
group timeout, with an error naming that rank and why.

Four gloo ranks run the residual MLP under Megatron 1D on dp=2 x tp=2, so every collective of a step runs in a
DeviceMesh sub-group, which torch creates with gloo's default 30-minute timeout unless autoshard aligns it
with the default group's (`COLLECTIVE_TIMEOUT_S` here). Rank 1's loss function fails; its peers are then
waiting for it in the backward collectives. Each world ends on its own: `run_outcomes` kills nothing before
`DEADLINE_S`, and a rank still alive then is reported "hung".

A plan made for another world size is covered by test_runtime_contract.py
(`test_plan_for_another_world_size_fails_on_every_rank_with_a_runtime_setup_error`).
"""

from __future__ import annotations

import functools
import re

import pytest
from dist_checks import fail_on_rank
from dist_ckpt import BATCH, rank_fails_in_train_step, run_outcomes
from dist_harness import run_world
from dist_models import build, example_batch
from dist_plans import make_plan

from autoshard.plans.layouts import MeshSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

WORLD = 4
# the world whose failed rank stays alive waits for it; in the others nobody should, so a long timeout there
# keeps slow startup on 2 shared cores from being mistaken for waiting
COLLECTIVE_TIMEOUT_S = 10.0
LONG_TIMEOUT_S = 40.0
DEADLINE_S = 60.0
REASON = "ValueError: the targets of rank 1 hold NaN (simulated)"


@functools.cache
def _case(mode: str, public_api: bool = False) -> dict:
    from autoshard.capture import capture

    x, _ = example_batch("mlp", 2)
    graph = capture(build("mlp"), (x,))
    plan = make_plan(graph, MeshSpec.of(dp=2, tp=2), "megatron", global_batch=BATCH)
    return {"model": "mlp", "plan": plan, "graph": graph, "failing_rank": 1, "mode": mode,
            "public_api": public_api, "stay_s": COLLECTIVE_TIMEOUT_S + 10}


@functools.cache
def _outcomes(mode: str, public_api: bool = False) -> list[dict]:
    timeout_s = COLLECTIVE_TIMEOUT_S if mode == "stay" else LONG_TIMEOUT_S
    return run_outcomes(rank_fails_in_train_step, WORLD, _case(mode, public_api), collective_timeout_s=timeout_s,
                        deadline_s=DEADLINE_S)


def _peers(outcomes: list[dict]) -> list[dict]:
    return [o for r, o in enumerate(outcomes) if r != 1]


@pytest.mark.timeout(120)
def test_rank_error_in_train_step_is_named_on_every_other_rank_without_waiting_for_the_timeout():
    outcomes = _outcomes("raise")
    assert outcomes[1]["status"] == "error" and outcomes[1]["type"] == "ValueError"
    for rank, outcome in enumerate(outcomes):
        if rank == 1:
            continue
        assert outcome["type"] == "RankFailedError", outcome
        # the failure every rank had and handled in the previous train_step (no loss_fn) is not blamed
        assert outcome["message"].startswith(f"rank 1 failed in train_step: {REASON}; rank {rank} stopped in "
                                             "train_step waiting for it ("), outcome["message"]
    # rank 1's sockets close when its process exits: nobody waits for the collective timeout
    assert all(o["elapsed_s"] < LONG_TIMEOUT_S / 4 for o in outcomes), [o["elapsed_s"] for o in outcomes]


@pytest.mark.long
@pytest.mark.timeout(120)
def test_peers_of_a_failed_rank_that_stays_alive_fail_within_the_group_timeout():
    # through autoparallel: the mesh's sub-groups get the default group's timeout; rank 1 stays alive for
    # longer than it, so only the timeout can end its peers' collectives
    outcomes = _outcomes("stay", public_api=True)
    assert outcomes[1]["type"] == "ValueError"
    assert outcomes[1]["elapsed_s"] >= COLLECTIVE_TIMEOUT_S + 10
    for outcome in _peers(outcomes):
        assert outcome["type"] == "RankFailedError", outcome
        assert outcome["message"].startswith(f"rank 1 failed in train_step: {REASON}; ")
        # ended by the timeout, not by rank 1 leaving: before rank 1's own end (>= timeout + 10 s), a bound
        # taken in the same run, so a loaded machine that slows every rank alike does not fail it
        assert COLLECTIVE_TIMEOUT_S <= outcome["elapsed_s"] < outcomes[1]["elapsed_s"], outcome


@pytest.mark.timeout(120)
def test_killed_rank_is_named_from_its_stopped_heartbeat():
    outcomes = _outcomes("killed")
    assert outcomes[1]["status"] == "no result"  # os._exit: no Python error, nothing recorded
    for rank, outcome in enumerate(outcomes):
        if rank == 1:
            continue
        assert outcome["type"] == "RankFailedError", outcome
        assert outcome["message"].startswith("rank 1 stopped responding: the process died or was killed; "
                                             f"rank {rank} stopped in train_step waiting for it")
        # rank 1's sockets closed: the peers wait for a failure record (2 s), then read the heartbeats over
        # 2.5 beats (5 s), not for the collective timeout
        assert outcome["elapsed_s"] < LONG_TIMEOUT_S / 2


@pytest.mark.timeout(120)
def test_a_failed_world_reports_the_first_error_and_how_every_rank_ended():
    # a rank that times out in a collective leaves, and its peers then fail with "connection reset": the first
    # traceback is not always the cause, so the report ends with every rank's outcome
    with pytest.raises(RuntimeError) as err:
        run_world(fail_on_rank, 2, 1, timeout_s=90)
    message = str(err.value)
    assert message.startswith("rank 1 failed:") and "Traceback" in message
    summary = message.rsplit("every rank: ", 1)[1]
    assert re.fullmatch(r"rank 0 (ok|no result \(killed, or crashed in native code\)); "
                        r"rank 1 ValueError: simulated failure of rank 1", summary), summary
