"""Peer swarming: nodes serve each other the shards they verified, over libp2p (``host.Swarm``)."""
