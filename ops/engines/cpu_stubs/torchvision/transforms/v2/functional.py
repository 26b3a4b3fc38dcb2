"""``torchvision.transforms.v2.functional`` of genq's test-only stand-in; see ``torchvision/__init__.py``."""

from torchvision import placeholders
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]

__getattr__ = placeholders(__name__)
