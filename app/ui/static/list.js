// Live sessions list: long-polls the feed (/ui/feed, the /v1/events long-poll) and
// adds sessions opened since the page was rendered, updates node counts and status.
// Every value from the server is written with textContent / setAttribute: never HTML.
"use strict";
(function () {
  const body = document.getElementById("session-rows");
  if (!body) return;
  const live = document.getElementById("live");
  let feedCursor = body.dataset.feedCursor;
  let listCursor = body.dataset.listCursor;
  const filterQuery = body.dataset.filterQuery;
  const statusFilter = new URLSearchParams(filterQuery).get("status");
  // A reward or sample-status filter: a newly opened session (no samples yet) never
  // matches it, so none is added live.
  const viewFiltering = body.dataset.viewFiltering === "1";

  const el = window.turnlogUi.el;

  function labelText(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  function rowFor(s) {
    const tr = el("tr", null, "fresh");
    tr.setAttribute("data-testid", "session-row");
    tr.setAttribute("data-session-id", s.session_id);
    tr.setAttribute("data-status", s.status);
    const link = el("a", s.session_id);
    link.href = "/ui/sessions/" + encodeURIComponent(s.session_id);
    const first = el("td"); first.appendChild(link); tr.appendChild(first);
    tr.appendChild(el("td", s.status, "status " + s.status));
    tr.appendChild(el("td", s.version));
    tr.appendChild(el("td", s.r3 ? (s.use_addition_r3 ? "add" : "full") + " · " + s.r3.num_layers + "L" : "—"));
    tr.appendChild(el("td", s.num_nodes, "num nodes"));
    // Samples, reward, response length and sample status appear once it is closed
    // (on the next load): an open session has none.
    tr.appendChild(el("td", "—", "num samples"));
    tr.appendChild(el("td", "—", "num reward"));
    tr.appendChild(el("td", "—", "num response"));
    tr.appendChild(el("td", "—", "sample-status"));
    const labels = el("td", null, "labels");
    for (const [key, value] of Object.entries(s.labels || {})) {
      const chip = el("a", key + "=" + labelText(value), "chip");
      chip.href = "/ui?" + new URLSearchParams([[key, labelText(value)]]).toString();
      labels.appendChild(chip);
    }
    tr.appendChild(labels);
    tr.appendChild(el("td", s.created_at.slice(0, 19).replace("T", " "), "muted"));
    return tr;
  }

  function findRow(sid) {
    for (const tr of body.querySelectorAll("tr[data-session-id]")) {
      if (tr.dataset.sessionId === sid) return tr;
    }
    return null;
  }

  async function addNewSessions() {
    const params = new URLSearchParams(filterQuery);
    params.set("after", listCursor);
    const reply = await fetch("/ui/rows?" + params.toString(), { credentials: "same-origin" });
    if (!reply.ok) throw new Error("rows " + reply.status);
    const page = await reply.json();
    for (const s of page.sessions) {
      if (findRow(s.session_id)) continue;
      body.insertBefore(rowFor(s), body.firstChild);
    }
    listCursor = page.next;
    const empty = document.getElementById("no-sessions");
    if (empty && body.firstChild) empty.remove();
  }

  function applyEvent(event) {
    const tr = findRow(event.session_id);
    if (!tr) return;
    if (event.type === "turn_recorded") {
      // seq is the node id, so the count is max(seq) + 1: exact however events repeat.
      const cell = tr.querySelector("td.nodes");
      cell.textContent = String(Math.max(Number(cell.textContent), event.seq + 1));
    } else if (event.type === "session_closed") {
      const cell = tr.querySelector("td.status");
      cell.textContent = "closed";
      cell.className = "status closed";
      tr.setAttribute("data-status", "closed");
      if (statusFilter === "open") tr.remove();
    }
  }

  async function poll() {
    // The first call answers at once (it shows the feed is reachable); then long-poll.
    let wait = 0;
    for (;;) {
      try {
        const reply = await fetch("/ui/feed?wait=" + wait + "&after=" + encodeURIComponent(feedCursor),
                                  { credentials: "same-origin" });
        if (!reply.ok) throw new Error("feed " + reply.status);
        const page = await reply.json();
        live.className = "live on";
        live.textContent = "live";
        if (!viewFiltering && page.events.some((e) => e.type === "session_opened")) {
          await addNewSessions();
        }
        for (const event of page.events) applyEvent(event);
        feedCursor = page.next;
        wait = 25;
      } catch (err) {
        live.className = "live off";
        live.textContent = "offline, retrying";
        await new Promise((resolve) => setTimeout(resolve, 3000));
      }
    }
  }
  poll();
})();
