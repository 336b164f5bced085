"""Everything that reads or writes the Kubernetes API: records, node inventory, cache, watches."""
