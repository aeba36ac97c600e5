"""llama.cpp's compute backend and ``--gpu-layers``: which devices the loaded llama.cpp library can offload
to (ggml's backend registry, read through llama-cpp-python's library), and the ``n_gpu_layers`` a load gets.

Facts (llama.cpp as vendored by llama-cpp-python 0.3.36):
- ``llama_model_params.n_gpu_layers``: the repeating layers stored in VRAM, counted from the last, plus the
  output layer as layer n_layer + 1; a negative value means all of them. Token embeddings stay in RAM.
- ``llama_supports_gpu_offload()`` is true when a GPU backend (CUDA, Metal, Vulkan, HIP, SYCL, ...) is
  compiled into the library; a CPU build ignores ``n_gpu_layers``.
- The library used is llama-cpp-python's own, or the one ``LLAMA_CPP_LIB_PATH`` points at (e.g. a CUDA build
  of llama.cpp for this machine's GPU).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

from ..errors import UserError

ALL = "all"
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
# ggml backend registry names -> how a user names them, and how to build llama-cpp-python for them
BACKEND_BUILDS = {
    "CUDA": "CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall --no-binary llama-cpp-python "
            "llama-cpp-python",
    "Metal": "CMAKE_ARGS='-DGGML_METAL=on' pip install --force-reinstall --no-binary llama-cpp-python "
             "llama-cpp-python (the default on Apple Silicon)",
    "Vulkan": "CMAKE_ARGS='-DGGML_VULKAN=on' pip install --force-reinstall --no-binary llama-cpp-python "
              "llama-cpp-python",
    "ROCm": "CMAKE_ARGS='-DGGML_HIP=on' pip install --force-reinstall --no-binary llama-cpp-python llama-cpp-python",
}
REGISTRY_NAMES = {"CUDA": "CUDA", "Metal": "Metal", "MTL": "Metal", "Vulkan": "Vulkan", "ROCm": "ROCm",
                  "HIP": "ROCm", "SYCL": "SYCL", "CANN": "CANN", "OpenCL": "OpenCL", "RPC": "RPC", "CPU": "CPU",
                  "BLAS": "BLAS"}
GPU_BUILD_HINT = ("build llama-cpp-python with a GPU backend (NVIDIA: " + BACKEND_BUILDS["CUDA"] + "), or point "
                  "LLAMA_CPP_LIB_PATH at a GPU build of llama.cpp's libllama; --gpu-layers 0 runs on the CPU")


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: CPU, CUDA0, Metal, Vulkan0, ...
    description: str  # e.g. "NVIDIA H200", "AMD EPYC"
    kind: str  # one of DEVICE_TYPES' values
    free_bytes: int = 0
    total_bytes: int = 0


@dataclass(frozen=True)
class LlamaCppCompute:
    """What the loaded llama.cpp library computes on."""

    gpu_offload: bool  # llama_supports_gpu_offload()
    backends: tuple[str, ...]  # registered ggml backends, user-facing names (CPU, CUDA, Metal, ...)
    devices: tuple[Device, ...] = field(default_factory=tuple)

    @property
    def gpu_backend(self) -> str | None:
        """The first backend that is not the CPU's (CUDA, Metal, Vulkan, ...), or None on a CPU build."""
        return next((b for b in self.backends if b not in ("CPU", "BLAS", "RPC")), None)

    @property
    def label(self) -> str:
        return self.gpu_backend or "CPU"

    @property
    def gpu_devices(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind in ("gpu", "igpu"))

    def to_dict(self) -> dict:
        return {"backend": self.label, "gpu_offload": self.gpu_offload, "backends": list(self.backends),
                "devices": [vars(d) for d in self.devices]}


def _bind(lib, name: str, restype, argtypes: list) -> object:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


@functools.cache
def llamacpp_compute() -> LlamaCppCompute:
    """The loaded llama.cpp's backends and devices (ggml's registry, through libllama's dependencies)."""
    import llama_cpp

    llama_cpp.llama_backend_init()  # loads the backends a dynamic-backend build keeps in separate libraries
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    lib = llama_cpp.llama_cpp._lib
    try:
        reg_count = _bind(lib, "ggml_backend_reg_count", ctypes.c_size_t, [])
        reg_get = _bind(lib, "ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t])
        reg_name = _bind(lib, "ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p])
        dev_count = _bind(lib, "ggml_backend_dev_count", ctypes.c_size_t, [])
        dev_get = _bind(lib, "ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t])
        dev_name = _bind(lib, "ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p])
        dev_desc = _bind(lib, "ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p])
        dev_type = _bind(lib, "ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p])
        dev_memory = _bind(lib, "ggml_backend_dev_memory", None,
                           [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)])
    except AttributeError:  # a library that does not export ggml's registry: say only what llama.h says
        return LlamaCppCompute(offload, ("CPU", "GPU") if offload else ("CPU",))
    names = []
    for i in range(reg_count()):
        raw = (reg_name(reg_get(i)) or b"").decode()
        names.append(REGISTRY_NAMES.get(raw, raw))
    devices = []
    for i in range(dev_count()):
        dev = dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(Device((dev_name(dev) or b"").decode(), (dev_desc(dev) or b"").decode(),
                              DEVICE_TYPES.get(dev_type(dev), "unknown"), free.value, total.value))
    return LlamaCppCompute(offload, tuple(dict.fromkeys(names)), tuple(devices))


def parse_gpu_layers(value: int | str | None) -> int | str | None:
    """``--gpu-layers``'s value: None (the default: all on a GPU build, else 0), ``"all"`` or a count ≥ 0."""
    if value is None or value == ALL:
        return value
    if isinstance(value, str):
        if value.strip().lower() == ALL:
            return ALL
        try:
            value = int(value)
        except ValueError:
            raise UserError(f"--gpu-layers {value!r} is neither a number of layers nor 'all'",
                            "pass --gpu-layers all, --gpu-layers 0 (CPU only) or a layer count") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"--gpu-layers {value!r} must be 'all' or a count of at least 0",
                        "pass --gpu-layers all, --gpu-layers 0 (CPU only) or a layer count")
    return value


def n_gpu_layers(value: int | str | None, compute: LlamaCppCompute | None = None) -> int:
    """``llama_model_params.n_gpu_layers`` for ``--gpu-layers value``: -1 (all) or a count. The default (None)
    offloads everything where the loaded llama.cpp has a GPU backend and nothing elsewhere; asking a CPU
    build for GPU layers is refused, since llama.cpp would silently run them on the CPU."""
    value = parse_gpu_layers(value)
    if value == 0:
        return 0
    compute = compute or llamacpp_compute()
    if value is None:
        return -1 if compute.gpu_offload else 0
    if not compute.gpu_offload:
        raise UserError(f"--gpu-layers {value}: the loaded llama.cpp has no GPU backend (backends: "
                        f"{', '.join(compute.backends)}), so no layer can be offloaded", GPU_BUILD_HINT)
    return -1 if value == ALL else value


def offloaded_layers(n_gpu: int, n_layers: int) -> tuple[int, bool]:
    """(repeating layers in VRAM, whether the output layer is) for llama.cpp's ``n_gpu_layers`` = ``n_gpu``:
    the last ``n_gpu`` of the n_layers + 1 (the output layer last) are offloaded, so 1 offloads the output only."""
    n = n_layers + 1 if n_gpu < 0 else min(n_gpu, n_layers + 1)
    return max(n - 1, 0), n > 0
