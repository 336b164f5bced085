"""Single-host mode without Kubernetes: `qgpu run` and `qgpu manager serve --standalone`."""
