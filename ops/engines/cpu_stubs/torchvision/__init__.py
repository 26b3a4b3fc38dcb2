"""Test-only stand-in for ``torchvision`` so the real SGLang 0.5.23 starts beside a CPU-only torch.

PyPI's torchvision wheel is built against CUDA torch: beside torch 2.13.0+cpu its import fails
(``RuntimeError: operator torchvision::nms does not exist``). SGLang serves a text-only llama without
any image op, but imports torchvision at start-up, from ``sglang/srt/configs/__init__.py``:

    sglang/srt/multimodal/internvl_utils.py:5  import torchvision.transforms as T
    sglang/srt/multimodal/internvl_utils.py:7  from torchvision.transforms.functional import InterpolationMode
    sglang/srt/configs/deepseek_ocr.py:7       from torchvision.transforms import InterpolationMode
    sglang/srt/configs/deepseek_ocr.py:8       from torchvision.transforms import functional as TF

Once torchvision is importable, transformers takes it as installed, and the ``from transformers
import AutoProcessor`` of sglang/srt/configs/deepseekvl2.py:7 then loads these too:

    transformers/image_utils.py:54             from torchvision.io import ImageReadMode, decode_image
    transformers/image_utils.py:56             from torchvision.transforms.functional import pil_to_tensor
    transformers/image_processing_utils.py:48  from torchvision.transforms.v2 import functional as tvF

Put ``ops/engines/cpu_stubs`` first on ``PYTHONPATH``. ``InterpolationMode`` is the real enum (module
level code builds tables from it); every other public name of these modules is a placeholder class
that raises NotImplementedError when called, so an image code path fails loudly, not silently.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

__version__ = "0.28.0+genq.cpu.stub"  # the torchvision release that pairs with torch 2.13


def placeholders(module: str) -> Callable[[str], type]:
    """A module ``__getattr__`` that makes a raising placeholder class for each public name."""

    @cache
    def __getattr__(name: str) -> type:
        if name.startswith("_"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        def __init__(self: object, *args: object, **kwargs: object) -> None:
            raise NotImplementedError(
                f"{module}.{name} is not in genq's torchvision stand-in (ops/engines/cpu_stubs)"
            )

        return type(name, (), {"__init__": __init__, "__module__": module})

    return __getattr__
