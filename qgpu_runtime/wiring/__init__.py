"""kube-scheduler's wiring to the qgpu extender on a master.

``formats`` is pure (which config format each kube-scheduler reads; wiring and unwiring kubeadm's
static pod manifest) and is also what the kube_scheduler_extender role's filters call, so the
playbook and the master's re-wiring watcher edit the manifest with the same code. ``heal`` and
``cli`` are the watcher (`qgpu scheduler-wiring`): it notices a master upgrade that rewrote the
manifest and puts the wiring back.
"""
