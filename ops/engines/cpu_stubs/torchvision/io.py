"""``torchvision.io`` of genq's test-only stand-in; see ``torchvision/__init__.py``."""

from torchvision import placeholders

__getattr__ = placeholders(__name__)
