"""Faults injected at every request of a training step, a checkpoint save and a load: after each,
the last good checkpoint loads and training continues bit-identical to a run that never failed; on the
fast paths a failed step is rolled back entirely (parameters on NVMe have two slots, committed with the
optimizer's state), so the engine saves and goes on from it as from the checkpoint; an engine whose
chunked step failed part way refuses to step or save until it is loaded; a failed initialize leaves
the model as it was and no file behind."""

from __future__ import annotations

import errno

import pytest
import torch

from offload.train.engine import initialize
from tensorio import TensorIOError
from tensorio.testing import FailNth, inject_faults
from test_engine import assert_same_tensors, engine_config, mlp, mlp_batches, mlp_loss, parameters_now, train

BATCHES = mlp_batches(4)

# gradient_clipping 0: the updates run during backward; 1.0: in the next forward; with half the optimizer
# state in memory and the parameters on NVMe: after backward, in chunks (docs/engine.md). On a host too
# small to keep the gradients, those of on-disk partitions wait in the partitions' free slots.
CONFIGS = {"in backward": {}, "in the next forward": {"gradient_clipping": 1.0},
           "gradients in the parameter slots": {"gradient_clipping": 1.0, "host": 1 << 10},
           "after backward": {"gradient_clipping": 1.0, "ratio": 0.5}}


@pytest.fixture(params=list(CONFIGS))
def engine(request, disk_dir, monkeypatch, aio_backend):
    import offload.train.sizing as sizing

    extra = dict(CONFIGS[request.param])
    ratio, host = extra.pop("ratio", 1.0), extra.pop("host", None)
    if host is not None:
        monkeypatch.setattr(sizing, "host_memory_bytes", lambda: host)
    config = engine_config(disk_dir, "nvme", "nvme", **extra)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    config["aio"] = aio_backend
    engine, *_ = initialize(model=mlp(), config=config)
    assert engine.param_store.swap._io().backend_name == aio_backend["backend"]
    stats = engine.stats()
    assert (stats.mode.value, stats.grads_in_param_slots) == {
        "in backward": ("during backward", False), "in the next forward": ("in the next forward", False),
        "gradients in the parameter slots": ("in the next forward", True), "after backward": ("after backward", False),
    }[request.param]
    yield engine
    engine.close()


def _continue_from(engine, ckpt):
    """Load the good checkpoint, take two steps: their losses and the parameters after them."""
    engine.load_checkpoint(ckpt.parent if ckpt.name == "whole" else ckpt, tag="whole" if ckpt.name == "whole" else None)
    losses = train(engine, BATCHES[2:], mlp_loss)
    return losses, parameters_now(engine)


def _check_whole(engine, tmp_path, params_after_two, reference, n):
    """After a failed step 3 that left (or rolled back to) the model of step 2: a save keeps it, and
    training resumed from that save is the uninterrupted run's."""
    assert engine.global_steps == 2
    assert_same_tensors(parameters_now(engine), params_after_two)
    engine.save_checkpoint(tmp_path, tag="whole")
    losses, params = _continue_from(engine, tmp_path / "whole")
    assert losses == reference[0], f"fault at request {n}"
    assert_same_tensors(params, reference[1])
    engine.load_checkpoint(tmp_path, tag="global_step2")  # latest names "whole" now
    (tmp_path / "latest").write_text("global_step2")


def test_a_fault_at_every_request_of_a_step_leaves_the_checkpoint_to_resume_from(engine, tmp_path, request):
    path = request.node.callspec.params["engine"]
    train(engine, BATCHES[:2], mlp_loss)
    engine.save_checkpoint(tmp_path)
    params_after_two = parameters_now(engine)
    reference = _continue_from(engine, tmp_path)
    engine.load_checkpoint(tmp_path)

    def step_three():
        """Step 3 whole: its forward, backward and step, and, when its update runs in the next forward,
        that forward (of step 4's batch, whose own backward never comes)."""
        nonlocal phase
        phase = "forward"
        loss = mlp_loss(engine, BATCHES[2])
        phase = "backward"
        engine.backward(loss)
        phase = "step"
        engine.step()
        if engine.stats().mode.value == "in the next forward":
            phase = "update"
            mlp_loss(engine, BATCHES[3])

    phase = ""
    with inject_faults() as counted:
        step_three()
    assert counted.count > 0
    failures = unfailed = 0
    failed_in: set[str] = set()
    for n in range(1, counted.count + 1):
        engine.load_checkpoint(tmp_path)
        fault = FailNth(n, errno.ENOSPC)
        raised = False
        with inject_faults(fault) as faults:
            try:
                step_three()
            except TensorIOError as error:
                raised = True
                failures += 1
                failed_in.add(phase)
                assert error.errno == errno.ENOSPC
                if phase == "update":  # the update failed in the next forward: rolled back entirely
                    _check_whole(engine, tmp_path, params_after_two, reference, n)
                elif phase != "forward":
                    with pytest.raises(RuntimeError, match=r"cannot step: .*step 3 failed") as refused:
                        engine.step()
                    if "failed part way" in str(refused.value):  # parameters may be partly updated
                        assert path == "after backward"  # the fast paths roll a failed step back entirely
                        assert "load_checkpoint" in str(refused.value)
                        with pytest.raises(RuntimeError, match=r"cannot save a checkpoint: step 3 failed part way"):
                            engine.save_checkpoint(tmp_path, tag="mixed")
                    else:  # only the gradients are lost: the parameters are whole (or rolled back), a save keeps them
                        _check_whole(engine, tmp_path, params_after_two, reference, n)
            else:
                unfailed += 1
                assert engine.global_steps == 3, f"fault at request {n}"
        assert faults.count >= 1
        if not raised:  # the step did not fail (a read ahead that nothing used, a request it had no
            # more, or one that failed after it returned): the next step is the uninterrupted run's, or raises the fault
            try:
                losses = train(engine, BATCHES[3:], mlp_loss)
                params = parameters_now(engine)
            except TensorIOError as error:  # reported at a later call (which one depends on when the write landed)
                assert error.errno == errno.ENOSPC and fault.hits == 1, f"fault at request {n}"
                if engine.global_steps == 3:  # step 4 failed before its update, step 3 whole: as the engine says, its
                    # gradients are dropped and it runs again
                    engine.zero_grad()
                    losses = train(engine, BATCHES[3:], mlp_loss)
                    assert losses == reference[0][1:], f"fault at request {n}"
                    assert_same_tensors(parameters_now(engine), reference[1])
                else:  # a write of step 3 that landed after it returned failed: step 3 (and any step after it, not
                    # committed before it) is rolled back whole
                    _check_whole(engine, tmp_path, params_after_two, reference, n)
            else:
                assert losses == reference[0][1:], f"fault at request {n}"
                assert_same_tensors(params, reference[1])
        assert not (tmp_path / "mixed").exists() and (tmp_path / "latest").read_text() == "global_step2"
        losses, params = _continue_from(engine, tmp_path)
        assert losses == reference[0], f"fault at request {n}"
        assert_same_tensors(params, reference[1])
    assert failures > 0 and failures + unfailed == counted.count  # writes at least fail loudly
    if engine.stats().mode.value == "in the next forward":  # the update's own reads and writes were hit too
        assert "update" in failed_in, failed_in


def test_a_fault_at_every_request_of_a_save_and_a_load_keeps_the_last_good_checkpoint(engine, tmp_path):
    train(engine, BATCHES[:2], mlp_loss)
    engine.save_checkpoint(tmp_path)
    reference = _continue_from(engine, tmp_path)
    engine.load_checkpoint(tmp_path)
    with inject_faults() as saving:
        engine.save_checkpoint(tmp_path, tag="again")
    with inject_faults() as loading:
        engine.load_checkpoint(tmp_path, tag="global_step2")
    for n in range(1, saving.count + 1):
        engine.load_checkpoint(tmp_path, tag="global_step2")
        with inject_faults(FailNth(n, errno.EIO)):
            with pytest.raises(TensorIOError):
                engine.save_checkpoint(tmp_path, tag="broken")
        assert not (tmp_path / "broken").exists()
        losses, params = _continue_from(engine, tmp_path)
        assert losses == reference[0], f"fault at save request {n}"
        assert_same_tensors(params, reference[1])
    for n in range(1, loading.count + 1):
        with inject_faults(FailNth(n, errno.EIO)):
            with pytest.raises(TensorIOError):
                engine.load_checkpoint(tmp_path, tag="global_step2")
        losses, params = _continue_from(engine, tmp_path)
        assert losses == reference[0], f"fault at load request {n}"
        assert_same_tensors(params, reference[1])


def test_a_failed_initialize_leaves_the_model_as_it_was_and_no_file(disk_dir):
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with inject_faults(FailNth(3, errno.ENOSPC, op="write")):
        with pytest.raises(TensorIOError) as info:
            initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme"))
    assert info.value.errno == errno.ENOSPC
    assert list(disk_dir.iterdir()) == []  # the swap files are gone
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme"))  # a retry works
    train(engine, BATCHES[:1], mlp_loss)
    engine.close()


def test_a_failed_initialize_under_bf16_gives_the_fp32_parameters_back(disk_dir):
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with inject_faults(FailNth(2, errno.ENOSPC, op="write")):
        with pytest.raises(TensorIOError):
            initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme", bf16={"enabled": True}))
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[name]), name
