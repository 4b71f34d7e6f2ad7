"""The HTTP kit the node's server and the cluster's gateway share, so each
answers the same way with one copy of the code:

- :mod:`~weenv.server.kit.errors`: weenv's error answers (``{"error": {"kind",
  "message"}}``, the status of each kind), validation errors as one line;
- :mod:`~weenv.server.kit.stream`: NDJSON streams that close their generator,
  a batch's lines in the order its items finish, with the undo of what a
  client that left never heard of;
- :mod:`~weenv.server.kit.paging`: E2B's list pages (``limit``, ``nextToken``,
  ``X-Next-Token``);
- :mod:`~weenv.server.kit.relay` / :mod:`~weenv.server.kit.wsrelay`: E2B's
  ``PORT-ID.`` hosts relayed, HTTP and WebSocket, within limits.
"""
