"""The DRA door: the kubelet DRA plugin (claims prepared into the store, CDI specs) and the ResourceSlice.

Never imports node/deviceplugin/; both doors share the modules of node/ (store, health, tenants, ...).
"""
