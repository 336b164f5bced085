"""kube-scheduler extender: filter, prioritize and bind GPU pods with the placement engine."""
