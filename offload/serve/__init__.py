"""An OpenAI-compatible generation server over `offload.infer`'s engine (``python -m offload.serve``;
docs/serving.md): requests that run at the same time share each read of the weights from NVMe.

`Batcher` runs requests in one batch that they join and leave between decode steps (it needs torch
and transformers only); `create_app` is the FastAPI app in front of it (the ``serve`` extra:
``pip install 'tensorio-offload[serve]'``), imported on first use so that the batcher works without it.
"""

from offload.infer.batch import Batcher, QueueFull, Ticket, Update

_APP = ("create_app",)


def __getattr__(name: str):
    """`create_app`, imported on first use: it needs FastAPI."""
    if name in _APP:
        from offload.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'offload.serve' has no attribute {name!r}")


__all__ = ["Batcher", "QueueFull", "Ticket", "Update", "create_app"]
