"""Local emulation: an emulated network on one machine, local launchers and ``peer swarm``. Never imported by
production code (``peer.net``, ``peer.swarm``, ``peer.node``, ``peer.compute``, ``peer.runtime``)."""
