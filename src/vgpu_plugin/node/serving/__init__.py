"""What a running plugin watches and talks to: the config and node-labels files, the API server."""
