"""The simulated device as torch sees it: a device type of its own ("simgpu"), computing on the CPU.

torch's PrivateUse1 slot is set up as a Python backend (`torch.utils.backend_registration`) named
``simgpu``. Its tensors are plain ``torch.Tensor`` objects whose ``device`` is ``simgpu:0``, as a CUDA
tensor's is ``cuda:0``: autograd, ``param.data = ...``, ``.to()``, ``.cpu()`` and the dispatcher treat
them as another device's. Underneath, each storage's bytes are host memory (a CPU tensor kept alive
by the storage), and every operator runs one Python kernel (`_run`): it views the device tensors'
bytes as CPU tensors (same address, sizes, strides), runs the CPU operator, and hands back a device
tensor (a view op's result shares its input's storage; an in-place op returns its input; any other
result is copied into new device memory). Nothing is faked: every result is the CPU's computation.

As on a GPU, an operator refuses to mix device tensors with host tensors other than 0-dim ones
("Expected all tensors to be on the same device ..."), except copies and indexing with host indices,
which CUDA also takes.

`install()` sets the backend up once per process (PrivateUse1 is process-wide); a process whose
PrivateUse1 slot another backend holds gets a clear error, and so does a process that can use CUDA:
torch then takes the registered PrivateUse1 backend as the process's accelerator, and every CUDA
backward fails inside autograd's engine (`CUDA_CONFLICT`).
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.utils._pytree as pytree

__all__ = ["DEVICE_TYPE", "HostSyncs", "count_host_syncs", "install", "host_view", "new_device_tensor",
           "is_device_tensor"]

DEVICE_TYPE = "simgpu"
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


def is_device_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor of the simulated device."""
    return isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE


def new_device_tensor(size, stride, dtype: torch.dtype) -> torch.Tensor:
    """A new simgpu tensor of ``size`` and ``stride`` (contents undefined) over new host memory."""
    size, stride = tuple(size), tuple(stride)
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(s > 0 for s in size) else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    memory = torch.empty(max(extent, 1) * itemsize, dtype=torch.uint8)  # never a null pointer
    storage = torch._C._construct_storage_from_data_pointer(memory.data_ptr(), torch.device(DEVICE_TYPE, 0),
                                                           memory.numel())
    storage._simulated_memory = memory  # the device storage keeps its host bytes alive, and only it
    tensor = torch._C._acc.create_empty_tensor((0,), dtype)
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_CPU_KEYS, tensor, storage, 0, size, stride)


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes as simgpu ``tensor`` (same sizes, strides and offset): writes
    through either are seen by the other. For the simulated device's own bookkeeping and kernels."""
    memory = tensor.untyped_storage()._simulated_memory
    view = torch.empty(0, dtype=tensor.dtype)
    return view.set_(memory.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _to_host(value: object) -> object:
    return host_view(value) if is_device_tensor(value) else value


def _check_same_device(op: torch._ops.OpOverload, tensors: list[torch.Tensor]) -> None:
    if op.name() in _MIXING_ALLOWED:
        return
    host = next((t for t in tensors if t.device.type == "cpu" and t.dim() > 0), None)
    if host is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE_TYPE}:0 and "
            f"cpu! (in {op.name()}: a host tensor of shape {tuple(host.shape)} with a tensor on the simulated "
            f"device; move it with .to(device) first, as on a GPU)")


def _to_device(result: torch.Tensor) -> torch.Tensor:
    out = new_device_tensor(result.size(), result.stride() if result.numel() else [1] * result.dim(), result.dtype)
    host_view(out).copy_(result)
    return out


def _adopt(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """An out= or in-place op the CPU kernel resized (its host view got new memory): device ``tensor``
    takes the new size, in new device memory holding ``result``."""
    if result.shape == tensor.shape and result.data_ptr() == tensor.data_ptr() and result.stride() == tensor.stride():
        return
    moved = _to_device(result)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, tensor, moved.untyped_storage(), moved.storage_offset(), moved.size(), moved.stride())


def _run(op: torch._ops.OpOverload, *args, **kwargs):
    """Every simgpu operator: the CPU's kernel on host views of the device tensors (module docstring)."""
    flat, _ = pytree.tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    _check_same_device(op, tensors)
    wants_device = isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == DEVICE_TYPE
    if wants_device:
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
        elif tensors and any(is_device_tensor(t) for t in tensors) or wants_device:
            wrapped.append(_to_device(value))
        else:
            wrapped.append(value)
    if isinstance(result, tuple):
        return tuple(wrapped)
    if isinstance(result, list):
        return wrapped
    return wrapped[0]


def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    stride = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format).stride()
    return new_device_tensor(size, stride, dtype)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return new_device_tensor(size, stride, dtype or torch.get_default_dtype())


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
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

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
