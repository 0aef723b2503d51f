"""Watching a swarm: the web dashboard, Prometheus metrics, TensorBoard/W&B scalars, terminal progress.

    peer.observe.dashboard   `peer dashboard` and the page a daemon serves with --dashboard-port
    peer.observe.snapshot    the swarm as JSON (/api/swarm) from the DHT's signed records
    peer.observe.watch       polling, and events derived from successive snapshots
    peer.observe.metrics     a daemon's /metrics (prometheus-client), transport counters from peer.net
    peer.observe.scalars     the leader's TensorBoard event files ([log] tensorboard_dir) and W&B
    peer.observe.progress    a live bar on a terminal, plain lines elsewhere
    peer.observe.node        what a daemon starts: metrics server, optional dashboard, progress
    peer.observe.phases      `peer join`'s phases: a line per phase, a bar while fetching or training
    peer.observe.logs        log formats: control characters made inert, or JSON lines (--json-log)

Layering: this package reads peer.swarm, peer.net, peer.config and peer.timing; peer.node and peer.cli use
it; nothing below them imports it.
"""
