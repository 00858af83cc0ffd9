"""The repository's benchmark scripts (not installed): ``python -m benchmarks.NAME --help`` from the clone.

They measure tensorio and offload against fio and in-memory baselines; docs/benchmarks.md has the
figures. Helpers they share live in ``benchmarks._common``; the installed tool is ``bench``
(`tensorio-bench`), which they may use and which never imports them.
"""
