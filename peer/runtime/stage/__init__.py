"""The peer side of training: one stage worker (one tasklet) and its parts (peer.runtime.stage.worker says
which does what). The leader side never imports this package; both share the contract modules of
``peer.runtime`` (control messages, spec, wire, roles, bounds, grants, checkpoints, stage state)."""
