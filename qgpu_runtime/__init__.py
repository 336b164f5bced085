"""qgpu: GPU sharing for Kubernetes and single hosts."""

__version__ = "0.1.0"
