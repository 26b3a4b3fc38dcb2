"""``torchvision.transforms.v2`` of genq's test-only stand-in; see ``torchvision/__init__.py``."""

from torchvision import placeholders
from torchvision.transforms.v2 import functional
from torchvision.transforms.v2.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]

__getattr__ = placeholders(__name__)
