"""``python -m qgpu_runtime.protos``: compile the kubelet protos ahead of first use."""

from qgpu_runtime.protos import build

if __name__ == "__main__":
    print(build())
