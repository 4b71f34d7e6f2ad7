"""The node daemon (``weenv serve``): the node's HTTP API on a Unix socket, and its client."""
