"""``python -m offload.generate CHECKPOINT --prompt TEXT | --prompt-ids 1,2,3 [...]``: see offload/infer/cli.py."""

from offload.infer.cli import main

if __name__ == "__main__":
    main()
