// Refresh the page's live part (#live) every data-refresh milliseconds: the
// same page is fetched again (same origin, its cookie) and its #live copied
// in when it changed. A redirect to the login form reloads the whole page.
(function () {
  "use strict";
  const live = document.getElementById("live");
  if (!live || !live.dataset.refresh) return;
  const every = Number(live.dataset.refresh);
  async function refresh() {
    try {
      const r = await fetch(location.pathname, { credentials: "same-origin", cache: "no-store" });
      if (r.redirected || !r.ok) { if (r.redirected) location.assign(r.url); return; }
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      const fresh = doc.getElementById("live");
      if (fresh && fresh.innerHTML !== live.innerHTML) live.innerHTML = fresh.innerHTML;
    } catch (e) { /* the node restarts or the network blinks: try again next time */ }
  }
  setInterval(refresh, every);
})();
