// Session page: collapsible tree, and a selected node's token lanes fetched on demand
// from /ui/sessions/{sid}/nodes/{seq}. Values are written with textContent only.
"use strict";
(function () {
  const tree = document.getElementById("tree");
  if (!tree) return;
  const sid = tree.dataset.sessionId;
  const rows = Array.from(tree.querySelectorAll(".row[data-seq]"));
  const bySeq = new Map(rows.map((tr) => [tr.dataset.seq, tr]));
  let selected = null;

  const el = window.turnlogUi.el;

  // Rows are in depth-first order: a subtree is rows[index..last]. Recompute
  // visibility in one pass so nested collapses compose.
  function layout() {
    let hideUntil = -1;
    rows.forEach((tr, index) => {
      tr.classList.toggle("collapsed-away", index <= hideUntil);
      if (index > hideUntil) {
        const toggle = tr.querySelector(".toggle");
        if (toggle && toggle.getAttribute("aria-expanded") === "false") {
          hideUntil = Number(tr.dataset.last);
        }
      }
    });
  }

  function logprobColour(lp) {
    const t = Math.max(0, Math.min(1, -lp / 6));
    return "hsl(" + Math.round(140 * (1 - t)) + ", 60%, 80%)";
  }

  function fact(dl, name, value) {
    const div = el("div");
    div.appendChild(el("dt", name));
    div.appendChild(el("dd", value === null || value === undefined ? "—" : value));
    dl.appendChild(div);
  }

  function render(node) {
    document.getElementById("node-hint").hidden = true;
    document.getElementById("node-view").hidden = false;
    document.getElementById("nv-seq").textContent = String(node.seq);
    const tr = bySeq.get(String(node.seq));
    const cells = tr ? tr.children : [];
    const facts = document.getElementById("nv-facts");
    facts.replaceChildren();
    fact(facts, "parent", cells.length ? cells[1].textContent : null);
    fact(facts, "finish", cells.length ? cells[3].textContent : null);
    fact(facts, "weights", cells.length ? cells[4].textContent : null);
    fact(facts, "new prompt tokens", node.new_prompt.length);
    fact(facts, "output tokens", node.output.length);
    if (node.loss) {
      fact(facts, "trained by sample", node.owner === null ? "none" : node.owner);
      fact(facts, "in samples", node.samples.length ? node.samples.join(", ") : "none");
    } else {
      fact(facts, "loss mask", "known once the session is closed");
    }
    const mismatch = document.getElementById("nv-mismatch");
    mismatch.replaceChildren();
    for (const line of node.mismatch || []) mismatch.appendChild(el("li", line));
    document.getElementById("nv-mismatch-box").hidden = !(node.mismatch && node.mismatch.length);

    const spec = document.getElementById("nv-spec");
    spec.replaceChildren();
    const keys = ["spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
                  "completion_tokens", "contributes", "accept_rate", "accept_length"];
    for (const key of keys) {
      const row = el("tr");
      row.appendChild(el("td", key));
      const value = node.spec[key];
      row.appendChild(el("td", typeof value === "number" && !Number.isInteger(value) ? value.toFixed(3) : value, "num"));
      spec.appendChild(row);
    }

    const messages = document.getElementById("nv-messages");
    messages.replaceChildren();
    const all = node.messages.slice();
    if (node.reply) all.push(node.reply);
    for (const m of all) {
      const box = el("div", null, "msg " + (m.role === "assistant" ? "assistant" : "other"));
      box.appendChild(el("span", m.role, "role"));
      box.appendChild(document.createTextNode(m.content));
      messages.appendChild(box);
    }
    if (!all.length) messages.appendChild(el("p", "no messages in the record", "muted"));

    document.getElementById("nv-shared").textContent = String(node.prompt_shared);
    const prompt = document.getElementById("nv-prompt");
    const chips = document.createDocumentFragment();
    // With a tokenizer (TURNLOG_TOKENIZER) a chip shows the token's text, its id in
    // data-id and the title; without one, the id.
    node.new_prompt.forEach((id, i) => {
      const chip = el("span", node.prompt_text ? node.prompt_text[i] : id,
                      node.prompt_text ? "tok text" : "tok");
      chip.setAttribute("data-id", String(id));
      chip.title = "id " + id;
      chips.appendChild(chip);
    });
    prompt.replaceChildren(chips);

    const output = document.getElementById("nv-output");
    const outChips = document.createDocumentFragment();
    node.output.forEach((id, i) => {
      let cls = "tok";
      let loss = "unknown (open session)";
      if (node.loss) {
        if (!node.in_sample[i]) { cls += " cut"; loss = "not in any sample"; }
        else { cls += node.loss[i] ? " loss1" : " loss0"; loss = String(node.loss[i]); }
      }
      const chip = el("span", node.output_text ? node.output_text[i] : id,
                      node.output_text ? cls + " text" : cls);
      chip.setAttribute("data-id", String(id));
      chip.style.backgroundColor = logprobColour(node.logprobs[i]);
      chip.title = "id " + id + " · logprob " + node.logprobs[i] + " · loss " + loss;
      chip.setAttribute("data-loss", node.loss ? String(node.loss[i]) : "");
      outChips.appendChild(chip);
    });
    output.replaceChildren(outChips);
  }

  async function select(seq) {
    const tr = bySeq.get(String(seq));
    if (!tr) return;
    if (selected) selected.classList.remove("selected");
    selected = tr;
    tr.classList.add("selected");
    if (location.hash !== "#n" + seq) history.replaceState(null, "", "#n" + seq);
    const reply = await fetch("/ui/sessions/" + encodeURIComponent(sid) + "/nodes/" + seq,
                              { credentials: "same-origin" });
    if (selected !== tr) return;
    if (!reply.ok) {
      document.getElementById("node-hint").hidden = false;
      document.getElementById("node-hint").textContent = "could not load node " + seq + " (" + reply.status + ")";
      return;
    }
    render(await reply.json());
  }

  tree.addEventListener("click", (event) => {
    const toggle = event.target.closest(".toggle");
    if (toggle) {
      const open = toggle.getAttribute("aria-expanded") === "true";
      toggle.setAttribute("aria-expanded", open ? "false" : "true");
      layout();
      return;
    }
    const tr = event.target.closest(".row[data-seq]");
    if (tr) select(tr.dataset.seq);
  });
  tree.addEventListener("keydown", (event) => {
    // Enter on a collapse triangle only toggles (its button clicks itself).
    if (event.target.closest(".toggle")) return;
    const tr = event.target.closest(".row[data-seq]");
    if (tr && event.key === "Enter") select(tr.dataset.seq);
  });
  for (const link of document.querySelectorAll("a.goto")) {
    link.addEventListener("click", (event) => {
      event.preventDefault();
      const tr = bySeq.get(link.dataset.seq);
      if (tr) { tr.scrollIntoView({ block: "center" }); select(link.dataset.seq); }
    });
  }
  const fromHash = /^#n(\d+)$/.exec(location.hash);
  if (fromHash) select(fromHash[1]);
})();
