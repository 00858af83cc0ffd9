"""The simulated device as torch sees it: a device type of its own ("simgpu"), computing on the CPU.

torch's PrivateUse1 slot is set up as a Python backend (`torch.utils.backend_registration`) named
``simgpu``. Its tensors are plain ``torch.Tensor`` objects whose ``device`` is ``simgpu:i``, as a CUDA
tensor's is ``cuda:i``: autograd, ``param.data = ...``, ``.to()``, ``.cpu()`` and the dispatcher treat
them as another device's. Underneath, each storage's bytes are host memory (a CPU tensor kept alive
by the storage), and every operator runs one Python kernel (`_run`): it views the device tensors'
bytes as CPU tensors (same address, sizes, strides), runs the CPU operator, and hands back a device
tensor (a view op's result shares its input's storage; an in-place op returns its input; any other
result is copied into new device memory). Nothing is faked: every result is the CPU's computation.

The process sees `device_count` devices (``OFFLOAD_SIMGPU_COUNT``, default 1), ``simgpu:0`` to
``simgpu:N-1``, and has a current one (`set_device`, process-wide), as CUDA's GPUs; an index beyond the
count fails as CUDA's "invalid device ordinal". An operator's result is on its inputs' device.

As on a GPU, an operator refuses to mix device tensors with host tensors other than 0-dim ones, or with
tensors of another index ("Expected all tensors to be on the same device ..."), except copies
(``.to()``, ``copy_``) and indexing with host indices, which CUDA also takes.

`install()` sets the backend up once per process (PrivateUse1 is process-wide); a process whose
PrivateUse1 slot another backend holds gets a clear error, and so does a process that can use CUDA:
torch then takes the registered PrivateUse1 backend as the process's accelerator, and every CUDA
backward fails inside autograd's engine (`CUDA_CONFLICT`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import torch
import torch.utils._pytree as pytree

__all__ = ["COUNT_ENV", "DEVICE_TYPE", "HostSyncs", "count_host_syncs", "current_device", "device_count", "install",
           "host_view", "new_device_tensor", "is_device_tensor", "set_device"]

DEVICE_TYPE = "simgpu"
COUNT_ENV = "OFFLOAD_SIMGPU_COUNT"
"""The environment variable that says how many simulated devices a process sees (default 1)."""
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_lock = threading.Lock()
_libraries: list = []
_installed = False

_MIXING_ALLOWED = {
    "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy", "aten::index.Tensor",
    "aten::index_put_", "aten::_index_put_impl_", "aten::index_put", "aten::_has_compatible_shallow_copy_type",
    "aten::set_.source_Storage_storage_offset", "aten::set_.source_Storage", "aten::is_pinned",
}
"""Operators that CUDA also runs on a device tensor together with host tensors."""

_SYNCING = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero", "aten::unique",
            "aten::_unique2", "aten::masked_select"}
"""Operators whose result on a GPU makes the host wait for the device: a value read back (``.item()``,
``bool(t)``, ``torch.equal``) or a result whose size depends on the data."""


class HostSyncs:
    """Where the host waited for the simulated device while counting (`count_host_syncs`), by cause: a copy
    to host memory ("to host"), an operator of `_SYNCING` (its name), a stream, event or device
    synchronisation of `SimulatedDevice` ("synchronize")."""

    def __init__(self) -> None:
        self.by_cause: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, cause: str) -> None:
        """Count one wait of the host for the device, for ``cause``."""
        with self._lock:
            self.by_cause[cause] = self.by_cause.get(cause, 0) + 1

    @property
    def total(self) -> int:
        """Every wait counted."""
        return sum(self.by_cause.values())


_counters: list[HostSyncs] = []


class count_host_syncs:
    """``with count_host_syncs() as syncs:`` counts where the host waits for the simulated device inside the
    block (`HostSyncs`): what a GPU's timeline would show as synchronisations (docs/device.md)."""

    def __enter__(self) -> HostSyncs:
        self.syncs = HostSyncs()
        _counters.append(self.syncs)
        return self.syncs

    def __exit__(self, *exc: object) -> None:
        _counters.remove(self.syncs)


def note_host_sync(cause: str) -> None:
    """Count a wait of the host for the device in every active `count_host_syncs`."""
    for counter in _counters:
        counter.add(cause)


_current = 0


def device_count() -> int:
    """How many simulated devices this process sees: ``OFFLOAD_SIMGPU_COUNT`` (default 1), read at each
    call. Raises ValueError naming the variable for anything but a whole number >= 1."""
    value = os.environ.get(COUNT_ENV, "1").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{COUNT_ENV}: {value!r} is not a device count; use a whole number >= 1 (default 1)")
    return int(value)


def check_index(index: int) -> int:
    """``index`` where it names one of the `device_count` devices; else RuntimeError, as CUDA's
    "invalid device ordinal" (``torch.cuda.set_device`` beyond the count), naming the count and its setting."""
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"{DEVICE_TYPE} error: invalid device ordinal {index}: this process sees {count} simulated "
                           f"device{'s' if count != 1 else ''} ({COUNT_ENV}={count}), {DEVICE_TYPE}:0 to "
                           f"{DEVICE_TYPE}:{count - 1}")
    return index


def current_device() -> int:
    """The index `set_device` last chose in this process (0 at first): where ``device="simgpu"`` goes."""
    return _current


def set_device(index: int | torch.device | str) -> None:
    """Make ``index`` the current simulated device (process-wide), as ``torch.cuda.set_device``.
    Raises RuntimeError for an index beyond `device_count` (`check_index`)."""
    global _current
    device = torch.device(DEVICE_TYPE, index) if isinstance(index, int) else torch.device(index)
    if device.type != DEVICE_TYPE or device.index is None:
        raise ValueError(f"set_device: {index!r} is not a {DEVICE_TYPE} device index")
    _current = check_index(device.index)


def _index_of(device: object) -> int:
    """The index a ``device=`` argument names (the current device where it names none)."""
    index = torch.device(device).index
    return current_device() if index is None else index


def is_device_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor of the simulated device."""
    return isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE


def new_device_tensor(size, stride, dtype: torch.dtype, index: int) -> torch.Tensor:
    """A new tensor on ``simgpu:index`` of ``size`` and ``stride`` (contents undefined) over new host
    memory. Raises RuntimeError for an index beyond `device_count` (`check_index`)."""
    size, stride = tuple(size), tuple(stride)
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(s > 0 for s in size) else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    memory = torch.empty(max(extent, 1) * itemsize, dtype=torch.uint8)  # never a null pointer
    storage = torch._C._construct_storage_from_data_pointer(memory.data_ptr(), torch.device(DEVICE_TYPE, index),
                                                           memory.numel())
    storage._simulated_memory = memory  # the device storage keeps its host bytes alive, and only it
    tensor = _blank(index, dtype)
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_CPU_KEYS, tensor, storage, 0, size, stride)


def _blank(index: int, dtype: torch.dtype) -> torch.Tensor:
    """A new, empty simgpu tensor on ``index`` (its storage is then set): torch's own for index 0; for
    another index an alias of a blank made once through DLPack, the one way torch builds a PrivateUse1
    tensor of a given index from Python (torch's `set_` refuses a storage of another index)."""
    if index == 0:
        return torch._C._acc.create_empty_tensor((0,), dtype)
    check_index(index)
    blank = _blanks.get((index, dtype))
    if blank is None:
        raw = _blanks.get((index, torch.uint8))
        if raw is None:
            raw = _blanks[(index, torch.uint8)] = _dlpack_blank(index)
        blank = _blanks[(index, dtype)] = torch.ops.aten.view.dtype.redispatch(_CPU_KEYS, raw, dtype)
    return torch.ops.aten.alias.default.redispatch(_CPU_KEYS, blank)


_blanks: dict[tuple[int, torch.dtype], torch.Tensor] = {}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_EXT_DEV = 12  # DLPack's kDLExtDev: torch reads it as PrivateUse1
_dlpack_kept: list = []
"""The DLPack structs of the blanks (one per index above 0, never freed: they have no deleter)."""


def _dlpack_blank(index: int) -> torch.Tensor:
    """A 0-element uint8 tensor on ``simgpu:index``, from a DLPack capsule (DLPack 0.8's layout)."""
    shape, strides, byte = (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(1), (ctypes.c_uint8 * 8)()
    managed = _DLManagedTensor(_DLTensor(ctypes.addressof(byte), _DLDevice(_DL_EXT_DEV, index), 1, _DLDataType(1, 8, 1),
                                         shape, strides, 0), None, None)
    _dlpack_kept.append((shape, strides, byte, managed))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch._C._from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes as simgpu ``tensor`` (same sizes, strides and offset): writes
    through either are seen by the other. For the simulated device's own bookkeeping and kernels."""
    memory = tensor.untyped_storage()._simulated_memory
    view = torch.empty(0, dtype=tensor.dtype)
    return view.set_(memory.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _to_host(value: object) -> object:
    return host_view(value) if is_device_tensor(value) else value


def _check_same_device(op: torch._ops.OpOverload, tensors: list[torch.Tensor]) -> int | None:
    """The index of the device tensors among ``tensors`` (None: none). Raises CUDA's RuntimeError for a
    host tensor (other than a 0-dim one) or a tensor of another index beside them."""
    devices = [t.device for t in tensors if t.device.type == DEVICE_TYPE]
    if not devices:
        return None
    if op.name() in _MIXING_ALLOWED:
        return devices[0].index
    other = next((d for d in devices if d != devices[0]), None)
    if other is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {devices[0]} and "
            f"{other}! (in {op.name()}: tensors on two simulated devices; move one with .to(), as on a GPU)")
    host = next((t for t in tensors if t.device.type == "cpu" and t.dim() > 0), None)
    if host is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {devices[0]} and "
            f"cpu! (in {op.name()}: a host tensor of shape {tuple(host.shape)} with a tensor on the simulated "
            f"device; move it with .to(device) first, as on a GPU)")
    return devices[0].index


def _to_device(result: torch.Tensor, index: int) -> torch.Tensor:
    out = new_device_tensor(result.size(), result.stride() if result.numel() else [1] * result.dim(), result.dtype,
                            index)
    host_view(out).copy_(result)
    return out


def _adopt(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """An out= or in-place op the CPU kernel resized (its host view got new memory): device ``tensor``
    takes the new size, in new device memory holding ``result``."""
    if result.shape == tensor.shape and result.data_ptr() == tensor.data_ptr() and result.stride() == tensor.stride():
        return
    moved = _to_device(result, tensor.device.index)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, tensor, moved.untyped_storage(), moved.storage_offset(), moved.size(), moved.stride())


def _run(op: torch._ops.OpOverload, *args, **kwargs):
    """Every simgpu operator: the CPU's kernel on host views of the device tensors (module docstring)."""
    flat, _ = pytree.tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on = _check_same_device(op, tensors)
    wants_device = isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == DEVICE_TYPE
    if wants_device:  # made on (or moved to) the device it names
        on = check_index(_index_of(kwargs["device"]))
        kwargs = {**kwargs, "device": torch.device("cpu")}
    host_args, host_kwargs = pytree.tree_map(_to_host, (args, kwargs))
    if op.name() in _SYNCING and _counters:
        note_host_sync(op.name())
    with torch._C._AutoDispatchBelowAutograd():
        result = op(*host_args, **host_kwargs)
    if op.name() == "aten::_to_copy" and not wants_device:
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == "cpu":
            if _counters and any(is_device_tensor(t) for t in tensors) and not kwargs.get("non_blocking"):
                note_host_sync("to host")
            return result  # a new host tensor (_to_copy always copies)
    schema = op._schema
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    # Which argument each returned alias refers to (an in-place op's self, an out= tensor, a view's base).
    arguments = dict(zip([a.name for a in schema.arguments], args))
    arguments.update(kwargs)
    wrapped = []
    for index, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            wrapped.append(value)
            continue
        # A Tensor[] result (split, unbind, ...) has one return whose alias covers every element.
        returned = schema.returns[0] if isinstance(result, list) else schema.returns[index]
        alias = returned.alias_info if returned is not None else None
        source = None
        if alias is not None:
            for argument in schema.arguments:
                info = argument.alias_info
                if info is not None and set(info.before_set) & set(alias.before_set):
                    source = arguments.get(argument.name)
                    break
        if alias is not None and alias.is_write and isinstance(source, torch.Tensor):
            if is_device_tensor(source):
                _adopt(source, value)
            wrapped.append(source)  # in place, or out=: the device tensor itself
        elif alias is not None and is_device_tensor(source):  # a view: shares the input's storage
            wrapped.append(source.as_strided(value.size(), value.stride(), value.storage_offset()))
        elif on is not None:
            wrapped.append(_to_device(value, on))
        else:
            wrapped.append(value)
    if isinstance(result, tuple):
        return tuple(wrapped)
    if isinstance(result, list):
        return wrapped
    return wrapped[0]


def _histc(values, bins=100, min=0, max=0):
    """``torch.histc``: CUDA's kernel counts every dtype, integers included (transformers' experts count their
    tokens that way off the CPU), the CPU's floating point only; integers are counted here in float64,
    exactly as CUDA bins them ((value - min) * bins / (max - min), the last edge in the last bin), and the
    counts returned in the input's dtype."""
    if values.is_floating_point():
        return _run(torch.ops.aten.histc.default, values, bins, min, max)
    return _run(torch.ops.aten.histc.default, values.double(), bins, min, max).to(values.dtype)


def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    stride = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format).stride()
    return new_device_tensor(size, stride, dtype, check_index(_index_of(device or DEVICE_TYPE)))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return new_device_tensor(size, stride, dtype or torch.get_default_dtype(),
                             check_index(_index_of(device or DEVICE_TYPE)))


def _as_strided(tensor, size, stride, storage_offset=None):
    return torch.ops.aten.as_strided.default.redispatch(_CPU_KEYS, tensor, size, stride, storage_offset)


def _copy_from(src, dst, non_blocking=False):
    if is_device_tensor(src) and not is_device_tensor(dst) and not non_blocking:
        note_host_sync("to host")
    _to_host(dst).copy_(_to_host(src))
    return dst


def _copy_from_and_resize(src, dst):
    if dst.shape != src.shape:
        raise RuntimeError(f"_copy_from_and_resize: the simulated device does not resize {tuple(dst.shape)} to "
                           f"{tuple(src.shape)}")
    return _copy_from(src, dst)


def _collective(op: torch._ops.OpOverload):
    """A c10d collective on simgpu tensors: the CPU's (gloo) on their host views, which share the bytes."""

    def run(*args, **kwargs):
        flat, _ = pytree.tree_flatten((args, kwargs))
        device_by_view = {}

        def to_host(value):
            if not is_device_tensor(value):
                return value
            view = host_view(value)
            device_by_view[(view.data_ptr(), tuple(view.shape), view.dtype)] = value
            return view

        host_args, host_kwargs = pytree.tree_map(to_host, (args, kwargs))
        result = op.redispatch(_CPU_KEYS, *host_args, **host_kwargs)

        def back(value):
            if isinstance(value, torch.Tensor):
                return device_by_view.get((value.data_ptr(), tuple(value.shape), value.dtype), value)
            return value

        return pytree.tree_map(back, result)

    return run


def _compatible(a, b):
    return a.layout == torch.strided and b.layout == torch.strided


class _BackendModule:
    """``torch.simgpu``: what torch asks a device module (autocast's dtypes, the RNG that activation
    checkpointing saves). The simulated device draws random numbers from the CPU's generator, so its
    RNG state is the CPU's."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return current_device()

    @staticmethod
    def device_count() -> int:
        return device_count()

    @staticmethod
    def set_device(index: int | torch.device | str) -> None:
        """As ``torch.cuda.set_device``: RuntimeError beyond the count."""
        set_device(index)

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Called by ``torch.manual_seed``, which seeds the CPU's generator: the one this device draws from."""

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def get_rng_state(device: object = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: object = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def synchronize(device: object = None) -> None:
        """Compute runs when issued on the simulated device: nothing to wait for."""


CUDA_CONFLICT = (
    "the simulated device cannot share a process with CUDA: once a PrivateUse1 backend is registered, torch "
    "takes it as the process's accelerator, and CUDA's backward then fails inside torch's autograd engine "
    "(\"opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED\", seen on an H200 with torch 2.11); run "
    "the simulated device where CUDA is hidden (CUDA_VISIBLE_DEVICES= python -m pytest -m simulated)")
"""Why `install` refuses where CUDA is available."""


def install() -> None:
    """Set the ``simgpu`` backend up (once per process). Raises RuntimeError where CUDA is available
    (`CUDA_CONFLICT`) or another backend holds torch's PrivateUse1 slot."""
    global _installed
    with _lock:
        if torch.cuda.is_available():
            raise RuntimeError(CUDA_CONFLICT)
        if _installed:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(f"the simulated device needs torch's PrivateUse1 backend slot, which {current!r} "
                               f"holds in this process; run the simulated device's tests in another process")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        if current != DEVICE_TYPE:
            _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_BackendModule())
        aten = torch.library.Library("aten", "IMPL")
        aten.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
        aten.impl("empty_strided", _empty_strided, "PrivateUse1")
        aten.impl("as_strided", _as_strided, "PrivateUse1")
        aten.impl("_copy_from", _copy_from, "PrivateUse1")
        aten.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        aten.impl("_has_compatible_shallow_copy_type", _compatible, "PrivateUse1")
        aten.impl("histc", _histc, "PrivateUse1")
        c10d = torch.library.Library("c10d", "IMPL")
        with warnings.catch_warnings():  # c10d's own PrivateUse1 kernels look for a backend of the device type
            warnings.simplefilter("ignore")
            for name in torch._C._dispatch_get_all_op_names():
                if not name.startswith("c10d::"):
                    continue
                packet = getattr(torch.ops.c10d, name.split("::")[1].split(".")[0])
                for overload in packet.overloads():
                    op = getattr(packet, overload)
                    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "PrivateUse1"):
                        c10d.impl(op._schema.overload_name and f"{op.name().split('::')[1]}.{op._schema.overload_name}"
                                  or op.name().split("::")[1], _collective(op), "PrivateUse1")
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_run, dispatch_key="PrivateUse1")
        # The CPU kernels resize the 0-dim out= tensors torch's composite kernels make for a backend: not
        # the caller's doing, and the device tensor takes the new size (`_adopt`).
        warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
        _libraries.extend([aten, c10d, fallback])  # registrations last as long as their Library objects
        _installed = True
