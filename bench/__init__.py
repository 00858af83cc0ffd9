"""`tensorio-bench`: validate a swap directory, measure and sweep the aio settings, compare with fio.

Installed with the project; it needs tensorio (and tqdm, and matplotlib for the sweep's chart) and
never imports offload or a model library. The repository's benchmark scripts are in ``benchmarks/``.
"""
