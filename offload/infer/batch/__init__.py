"""Continuous batching: requests that join and leave one running batch between decode steps, each
forward reading the streamed weights once for all of them. `Batcher` drives the engine's forward; the
server (offload/serve/) and ``python -m offload.generate --prompts-file`` hand it their requests."""

from offload.infer.batch.batcher import Batcher, QueueFull, Ticket, Update, check_settings, eos_token_ids

__all__ = ["Batcher", "QueueFull", "Ticket", "Update", "check_settings", "eos_token_ids"]
