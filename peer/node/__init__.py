"""The peer process: the daemon, the leader role it takes when elected, and planning from adverts."""
