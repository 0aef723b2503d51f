"""The control plane in the DHT: identity, signed records, adverts, membership, election, plans, status."""
