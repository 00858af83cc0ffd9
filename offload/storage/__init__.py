"""Files: the swap file, checkpoint directories and safetensors files.

`swapfile` is the one swap-file implementation (naming, mode 0600, liveness lock, page-aligned
extents with slots, I/O through tensorio, removal), `striped` stripes one over several drives, in
proportion to their speeds (`drive_speed` measures them);
`checkpoint_dir` makes checkpoint directories appear whole or not at all; `safetensors_writer` writes
safetensors files piece by piece (with O_DIRECT through `direct_writes` when given a tensorio handle).
"""

from offload.storage.checkpoint_dir import LATEST, CheckpointInUseError, atomic_checkpoint, resolve_tag
from offload.storage.safetensors_writer import SafetensorsWriter, atomic_safetensors, save_tensors_safetensors
from offload.storage.striped import StripedSwapFile, StripeLayout, open_swap_file
from offload.storage.swapfile import SwapFile, remove_stale_swap_files, stale_swap_files

__all__ = [
    "CheckpointInUseError",
    "LATEST",
    "SafetensorsWriter",
    "StripeLayout",
    "StripedSwapFile",
    "SwapFile",
    "atomic_checkpoint",
    "atomic_safetensors",
    "open_swap_file",
    "remove_stale_swap_files",
    "resolve_tag",
    "save_tensors_safetensors",
    "stale_swap_files",
]
