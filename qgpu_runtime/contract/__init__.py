"""What two qgpu processes must agree on: the contract room.

The allocation record on pods, the card inventory on nodes, the label/annotation/taint names and
the node store's schema. Every producer and consumer (extender, webhook, node manager, device
plugin, `qgpu status`, standalone, the roles' templates) imports these from here and nowhere
else; docs/annotations.md is the normative description. Pure apart from the store schema, which
speaks SQLite.
"""
