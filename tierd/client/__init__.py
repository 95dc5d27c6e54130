"""Client side: the daemon session, the store client, the training hooks."""
