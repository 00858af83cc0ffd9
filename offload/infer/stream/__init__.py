"""The streamer: each forward's weights, read from the checkpoint into a ring of locked buffers.

`unit` is the record of one streamed or resident unit; `streamer` is the ring (`LayerStreamer`) and the
hooks that bind a layer's parameters to its buffer; `resident_load` the background load of the units
kept in memory (`ResidentLoad`); `device_ring` copies host buffers to a compute device's own ring.
"""
