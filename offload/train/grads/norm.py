"""The global gradient norm DeepSpeed's engine reports (``get_global_grad_norm``): of the gradients
accumulated since the last step while there are any, else the one the last step took (unscaled, before
clipping), None before the first step."""

from __future__ import annotations

from offload.train.step.update_mode import FastPath, StepContext, UpdatePath


class GlobalGradNorm:
    """Which norm `Engine.get_global_grad_norm` returns, and the one each step keeps."""

    def __init__(self, ctx: StepContext, path: UpdatePath) -> None:
        self._ctx, self._path = ctx, path
        self.fresh = False
        """Gradients were accumulated since the last step or zero_grad."""
        self.last: float | None = None
        """The norm of the last step (before clipping, unscaled), None before the first."""

    def now(self) -> float | None:
        """The norm of the gradients accumulated since the last step if any (sync point: every rank calls
        it then), else the last step's."""
        return self._ctx.reducer.global_norm() if self.fresh else self.last

    def take_for_step(self) -> None:
        """Keep the norm of the step about to run (fp16: unscaled). Its wait for the gradients' writes may
        raise their error: handled as the step's own check would handle it."""
        ctx = self._ctx
        if ctx.agreement.active:  # several ranks: every rank makes the norm's all-reduce; the step agrees on it
            try:
                ctx.reducer.drain()
            except Exception as error:
                ctx.agreement.keep(error, "writing the gradients")
        try:
            norm = ctx.reducer.global_norm()
        except BaseException as error:
            # Updates ran during backward (only a fast path updates before the step): give the step up whole.
            if isinstance(self._path, FastPath) and self._path.changed_parameters():
                self._path.give_up(error, gradients_lost=True)
            else:  # nothing is updated yet: the parameters are whole
                ctx.gradients_lost_before_update(error)
            raise
        self.last = norm / ctx.loss_scaler.loss_scale if ctx.loss_scaler is not None else norm
