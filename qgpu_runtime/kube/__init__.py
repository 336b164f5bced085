"""The thin Kubernetes API edge: the client, retries and error classification.

Nothing here knows what a GPU is. What qgpu writes on API objects is defined in
qgpu_runtime.contract; the extender's watch cache lives in qgpu_runtime.extender.
"""
