"""``torchvision.transforms.functional`` of genq's test-only stand-in; see ``torchvision/__init__.py``."""

from enum import Enum

from torchvision import placeholders


class InterpolationMode(Enum):
    """Interpolation modes, as in torchvision 0.28 (values are the names torch's interpolate takes)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    # For PIL compatibility
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = placeholders(__name__)
