"""The device-plugin door: kubelet's Allocate path, from the resource kinds served to the grant returned.

Never imports node/dra/; both doors share the modules of node/ (store, health, tenants, ...).
"""
