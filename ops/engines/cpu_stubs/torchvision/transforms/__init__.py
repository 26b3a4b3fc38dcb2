"""``torchvision.transforms`` of genq's test-only stand-in; see ``torchvision/__init__.py``."""

from torchvision import placeholders
from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]

__getattr__ = placeholders(__name__)
