"""The planner: which weights and KV layers live where, pure arithmetic on sizes.

`units` is what the planners share (a unit's size, `BudgetError`, byte formatting); `host` splits the
units between host memory and the disk (`make_plan`, `Plan`, `place_kv`); `device` chooses what a
compute device with memory of its own keeps (`DeviceTier`, `place_device`).
"""
