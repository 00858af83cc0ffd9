"""The KV cache: a transformers `Cache` whose chosen layers keep their keys and values on NVMe.

`cache` holds the layers and their read/write ring (`OffloadedKVCache`, `KVRing`); `quant` stores keys
and values as 8- or 4-bit integers (``kv_offload.quantization``); `device` stages the host's layers to a
compute device with memory of its own, composed into the cache by the engine (`KVStager`).
"""
