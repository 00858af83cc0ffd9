"""``python -m offload.checkpoint consolidate SAVE_DIR OUTPUT_DIR``: a checkpoint of
``engine.save_checkpoint`` (saved by any number of ranks) into weights that ``from_pretrained`` loads;
``python -m offload.checkpoint verify CKPT``: every byte of a checkpoint checked against the checksums
its JSON records, without loading it.

    python -m offload.checkpoint consolidate ckpt/ out/ [--tag global_step100] [--dtype fp32|bf16|fp16]
                                             [--max-shard-size 5GB] [--exclude-frozen-parameters] [--debug]
                                             # or consolidate ckpt/global_step100 out/
    python -m offload.checkpoint verify ckpt/ [--tag global_step100]      # or verify ckpt/global_step100

``consolidate`` verifies what it reads too. ``verify`` prints a line per file as it passes and exits 0; a
corrupt byte, a missing file or a path that is not a checkpoint ends in one line and exit status 2, after
the lines of the files that passed before it.

Streams in runs of 64 MiB, reading ahead while it writes (memory under 1 GB whatever the model's size
or its largest tensor), with a progress bar. User errors end in one line; ``--debug`` (or ``OFFLOAD_DEBUG=1``) shows their traceback.

The Python functions, with DeepSpeed's names (``deepspeed.utils.zero_to_fp32``), are here too:
``get_fp32_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict``,
``load_state_dict_from_zero_checkpoint`` (see `offload.train.checkpoint.consolidate`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from offload.cli_errors import add_debug_flag, run_command
from offload.storage import resolve_tag
from offload.train.checkpoint.consolidate import (DTYPES, convert_zero_checkpoint_to_fp32_state_dict,
                                                  get_fp32_state_dict_from_zero_checkpoint,
                                                  load_state_dict_from_zero_checkpoint, parse_size)
from offload.train.checkpoint.files import states_file
from offload.train.checkpoint.verify import verify_checkpoint

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "main", "verify_checkpoint"]

PROG = "python -m offload.checkpoint"


def _consolidate(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_flag(ap)
    commands = ap.add_subparsers(dest="command", required=True)
    p = commands.add_parser("consolidate", help="a checkpoint into safetensors weights that from_pretrained loads")
    p.add_argument("checkpoint_dir", help="the save_dir of engine.save_checkpoint (holding `latest` and the tags), "
                                          "or one of its tag directories")
    p.add_argument("output_dir", help="where model.safetensors (or shards and their index) and config.json go")
    p.add_argument("--tag", help="the checkpoint tag (default: the one `latest` names)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the weights written (fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, such as 5GB or 500MB (5GB)")
    p.add_argument("--exclude-frozen-parameters", action="store_true", help="leave out parameters not trained")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(p)
    v = commands.add_parser("verify", help="check every byte of a checkpoint against its checksums")
    v.add_argument("checkpoint", help="a tag directory, or the save_dir holding it (with `latest` or --tag)")
    v.add_argument("--tag", help="the checkpoint tag in a save_dir (default: the one `latest` names)")
    add_debug_flag(v)
    args = ap.parse_args(argv)
    if args.command == "verify":
        files = verify_checkpoint(args.checkpoint, args.tag, on_file=lambda file: print(
            f"{'ok' if file.verified else 'unverified'} {file.path} ({file.nbytes / 1e6:.1f} MB)", flush=True))
        if not all(file.verified for file in files):
            print("the state files were saved before they carried a checksum of their own: their bytes cannot be "
                  "checked (save the checkpoint again to cover them)", file=sys.stderr)
        print(f"verified {len(files)} files, {sum(f.nbytes for f in files) / 1e9:.3f} GB: every checksum matches",
              file=sys.stderr)
        return
    parse_size(args.max_shard_size, "--max-shard-size")
    checkpoint_dir, tag = args.checkpoint_dir, args.tag
    if tag is None and (Path(checkpoint_dir) / states_file(0)).is_file():  # a tag directory, as verify takes
        tag_dir = Path(os.path.abspath(checkpoint_dir))
        checkpoint_dir, tag = str(tag_dir.parent), tag_dir.name
    resolve_tag(checkpoint_dir, tag, tag_argument="--tag TAG")  # the errors in the command's words
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, args.output_dir, args.max_shard_size,
                                               safe_serialization=True, tag=tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters,
                                               dtype=DTYPES[args.dtype], progress=not args.no_progress)
    print(f"wrote {args.output_dir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status (2 after a user error, printed as one line)."""
    return run_command(_consolidate, PROG, argv)

