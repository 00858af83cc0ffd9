"""The checkpoint's weights prepared once for generation, under ``nvme_path``.

`convert` writes a copy in another dtype; `quantize` swaps the decoder layers' linear layers for int8 /
int4 ones and `qcache` writes and reuses the quantized checkpoint they read.
"""
