"""Gradients, from autograd to the numbers the step uses.

`reduce` takes each parameter's gradient as it is final and reduces it to the owning rank's partition
(on the host; `device` does it on a compute device with memory of its own); `norm` is the global norm
DeepSpeed reports, `clip` clips to it, and `loss_scaler` scales fp16 losses (static or dynamic).
"""
