"""The node's dashboard: server-rendered HTML at ``/ui``, behind the API key.

- :mod:`.access`: who may see it (the ``weenv_key`` cookie the login form
  sets, ``X-API-Key`` or ``Authorization: Bearer``, the trusted Unix socket)
  and which posts are the page's own (same origin, the form's token).
- :mod:`.views`: the node's state as plain rows for the pages.
- :mod:`.charts`: small inline SVG (usage against quota, the tax by phase).
- :mod:`.routes`: the pages (environments, node health, templates, tax),
  the login form and the environment actions (kill, pause, resume, snapshot).

Pages refresh their live part every second (``static/ui.js``); without it
they still work, reloaded by hand.  Nothing below ``/ui`` but the login form
and the static assets answers without the key, and those hold no node data.
"""

from weenv.server.ui.routes import ui_router

__all__ = ["ui_router"]
