"""The per-node half of qgpu: kubelet device plugin, allocation store, reconciliation, metrics."""
