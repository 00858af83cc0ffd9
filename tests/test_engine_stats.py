"""`engine.stats()` and the engine's failure state (`offload.train.step.failure`)."""

from __future__ import annotations

import pytest

from offload.train.engine import initialize
from offload.train.step.failure import Failure, FailureState
from offload.train.step.update_mode import UpdateMode
from test_engine import engine_config, mlp, mlp_batches, mlp_loss, train


def test_lost_gradients_refuse_a_step_until_zero_grad():
    state = FailureState()
    state.check_step()  # nothing failed: no error
    state.gradients_lost("the backward of step 3 failed (RuntimeError: boom), so the accumulated gradients "
                         "are incomplete")
    with pytest.raises(RuntimeError, match=r"cannot step: the backward of step 3 failed .*call zero_grad\(\)"):
        state.check_step()
    state.check("save a checkpoint")  # the parameters are whole: a save is allowed
    state.gradients_cleared()
    assert (state.kind, state.reason) == (Failure.NONE, None)
    state.check_step()


def test_a_rollback_that_lost_gradients_is_remembered_once_they_are_cleared():
    state = FailureState()
    state.rolled_back("step 5 failed (TensorIOError: ENOSPC) and was rolled back entirely", gradients_lost=True)
    assert state.kind is Failure.GRADIENTS_LOST
    with pytest.raises(RuntimeError, match="rolled back entirely, and the gradients of this accumulation are lost"):
        state.check_step()
    state.gradients_cleared()
    assert state.kind is Failure.ROLLED_BACK and "step 5 failed" in state.reason
    state.check_step()  # training goes on


def test_partly_updated_parameters_refuse_step_and_save_until_a_load(tmp_path):
    state = FailureState()
    state.saved(str(tmp_path / "global_step2"))
    state.partly_updated("step 3 failed part way (TensorIOError: EIO)")
    state.gradients_lost("later backward failed")  # never downgrades the state
    state.rolled_back("step 3 failed and was rolled back entirely", gradients_lost=False)
    state.gradients_cleared()
    assert state.kind is Failure.PARTLY_UPDATED
    with pytest.raises(RuntimeError, match=r"cannot save a checkpoint: step 3 failed part way .* Resume with "
                                           r"load_checkpoint\(.*tag='global_step2'\)"):
        state.check("save a checkpoint")
    with pytest.raises(RuntimeError, match="cannot step: step 3 failed part way"):
        state.check_step()
    state.loaded(str(tmp_path / "global_step2"))
    assert (state.kind, state.reason, state.last_rollback) == (Failure.NONE, None, None)
    state.check_step()


@pytest.mark.parametrize("param,clip,mode", [("nvme", 0.0, UpdateMode.IN_BACKWARD),
                                             ("nvme", 1.0, UpdateMode.IN_FORWARD),
                                             ("cpu", 0.0, UpdateMode.AFTER_BACKWARD)])
def test_stats_report_the_mode_the_bytes_and_the_buffers(disk_dir, tmp_path, param, clip, mode):
    config = engine_config(disk_dir, param, "nvme" if mode is not UpdateMode.AFTER_BACKWARD else "cpu",
                           gradient_clipping=clip)
    engine, *_ = initialize(model=mlp(), config=config)
    stats = engine.stats()
    assert stats.mode is mode and stats.failure is Failure.NONE and stats.resume_from is None
    assert sum(stats.records.values()) == len(engine.records)
    assert stats.records["nvme"] == sum(rec.on_disk for rec in engine.records)
    train(engine, mlp_batches(3), mlp_loss)
    stats = engine.stats()
    if param == "nvme":
        assert stats.io["params"] == engine.io_bytes() and stats.io["params"]["read"] > 0
        assert 0 < stats.reads["demand"] + stats.reads["prefetch"] and stats.recorded_order > 0
    else:
        assert "params" not in stats.io and stats.buffers_held == 0
    assert ("optimizer" in stats.io) == (mode is not UpdateMode.AFTER_BACKWARD)
    assert stats.buffers_held <= stats.buffer_budget
    assert stats.steps_in_forward == (3 if mode is UpdateMode.IN_FORWARD else 0)
    assert stats.forwards_under_way == 0
    path = engine.save_checkpoint(tmp_path)
    assert engine.stats().resume_from == path
    engine.close()
