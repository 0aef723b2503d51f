"""Who a peer is: its RSA key and peer id (`keys.py`), and the certificate bound to that key (`certs.py`).

The lowest layer of ``peer``: the transport, the control plane and the runtime all build on it.
"""
