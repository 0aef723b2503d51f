"""The control-plane simulator: the real membership, election and planning code of ``peer.swarm`` and
``peer.node.planning`` against an in-memory DHT with a latency model, in virtual time, with churn
(``peer.emulation.cpsim.sim``), and sampled link measurement against the full matrix
(``peer.emulation.cpsim.sampling``)."""
