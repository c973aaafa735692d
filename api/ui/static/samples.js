// The sample browser (api/routers/samples.py): the list page filters and pages through
// GET /v1/runs/{run}/samples, the sample page renders GET /v1/runs/{run}/samples/{id}.
// The filters live in the page's query string, so a filtered list is a link.
(function () {
  "use strict";
  const SF = window.SF;
  const $ = (sel) => document.querySelector(sel);
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const num = (v, d) => (v === null || v === undefined ? "–" : d === undefined ? String(v) : Number(v).toFixed(d));
  // a model version's colour: distinct hues for neighbouring versions (golden angle)
  const colour = (v) => `hsl(${(v * 137.508) % 360}, 70%, 80%)`;

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    return body;
  }

  function problem(message) {
    const p = $("#problem");
    p.hidden = !message;
    p.textContent = message || "";
  }

  // ---- the list ---------------------------------------------------------------------------

  const FIELDS = ["step", "reward_min", "reward_max", "staleness_min", "staleness_max", "length_min", "length_max", "limit"];

  function formToParams(form) {
    const q = new URLSearchParams();
    form.querySelectorAll("input[name=status]:checked").forEach((i) => q.append("status", i.value));
    for (const f of FIELDS) {
      const v = form.elements[f].value.trim();
      if (v !== "") q.set(f, v);
    }
    return q;
  }

  function paramsToForm(form, q) {
    form.querySelectorAll("input[name=status]").forEach((i) => (i.checked = q.getAll("status").includes(i.value)));
    for (const f of FIELDS) form.elements[f].value = q.get(f) ?? "";
  }

  function row(r) {
    const href = `/ui/runs/${SF.run}/samples/${r.sample_id}`;
    return `<tr data-sample="${r.sample_id}" data-status="${esc(r.status)}">
      <td><a href="${href}">${r.sample_id}</a></td><td><span class="status ${esc(r.status)}">${esc(r.status.replace("_", " "))}</span></td>
      <td>${esc(r.state)}</td><td class="num">${num(r.step)}</td><td class="num">${num(r.v_traj)}</td>
      <td class="num" data-k="staleness">${num(r.staleness)}</td><td class="num" data-k="reward">${num(r.reward, 3)}</td>
      <td class="num" data-k="length">${r.n_tokens}</td><td class="num">${r.n_segments}</td>
      <td>${esc(r.finish_reason || r.reason || "")}</td><td>${esc(String(r.updated_at).slice(0, 19).replace("T", " "))}</td></tr>`;
  }

  function list() {
    const form = $("#filters");
    const body = $("#samples tbody");
    let next = null;
    async function load(before) {
      const q = formToParams(form);
      history.replaceState(null, "", q.toString() ? `?${q}` : location.pathname);
      if (before) q.set("before", before);
      try {
        const page = await getJSON(`/v1/runs/${SF.run}/samples?${q}`);
        problem("");
        next = page.next_before;
        // a page looks at a bounded window of samples: none matching in it is not the end
        const none = next === null ? "no samples match" : `none match above sample ${next}: older → to look further`;
        body.innerHTML = page.rows.map(row).join("") || `<tr><td colspan="11" class="empty">${none}</td></tr>`;
        $("#next").disabled = next === null;
        $("#count").textContent = `${page.rows.length} shown`;
        document.body.dataset.loaded = String(Date.now());
      } catch (e) {
        problem(e.message);
        body.innerHTML = "";
        document.body.dataset.loaded = String(Date.now());
      }
    }
    paramsToForm(form, new URLSearchParams(location.search));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      load(null);
    });
    form.addEventListener("reset", () => setTimeout(() => load(null), 0));
    $("#first").addEventListener("click", () => load(null));
    $("#next").addEventListener("click", () => next !== null && load(next));
    load(null);
  }

  // ---- one sample -------------------------------------------------------------------------

  function segmentHtml(s) {
    const content = s.text !== null ? esc(s.text) : esc(s.token_ids.join(" "));
    const title = s.generated
      ? `segment ${s.seq}: version ${s.version}, ${s.instance_name || s.instance_id}, attempt ${s.attempt}`
      : `segment ${s.seq}: observation (not generated)`;
    const style = s.generated ? ` style="background:${colour(s.version)}"` : "";
    const cls = s.generated ? "seg" : "seg observation";
    const v = s.generated ? ` data-version="${s.version}"` : "";
    return `<span class="${cls}" data-seq="${s.seq}"${v} title="${esc(title)}"${style}>${content}</span>`;
  }

  function turnsHtml(segments) {
    // consecutive generated segments form a turn; an observation sits between two turns
    const blocks = [];
    for (const s of segments) {
      const last = blocks[blocks.length - 1];
      if (s.generated && last && last.turn === s.turn) last.segs.push(s);
      else blocks.push({ turn: s.generated ? s.turn : null, after: s.after_turn, segs: [s] });
    }
    return blocks
      .map((b) =>
        b.turn !== null
          ? `<div class="turn" data-turn="${b.turn}"><h4>turn ${b.turn}</h4><pre class="tokens">${b.segs.map(segmentHtml).join("")}</pre></div>`
          : `<div class="turn observation" data-observation-after="${b.after}"><h4>observation</h4><pre class="tokens">${b.segs.map(segmentHtml).join("")}</pre></div>`,
      )
      .join("");
  }

  function fact(key, label, value) {
    return `<span data-k="${key}">${esc(label)} <b>${esc(value)}</b></span>`;
  }

  async function one() {
    let d;
    try {
      d = await getJSON(`/v1/runs/${SF.run}/samples/${SF.sample}`);
    } catch (e) {
      problem(e.message);
      document.body.dataset.loaded = String(Date.now());
      return;
    }
    const s = d.sample;
    $("#facts").innerHTML = [
      fact("status", "status", s.status.replace("_", " ")),
      fact("state", "state", s.state),
      fact("step", "step", num(s.step)),
      fact("v_traj", "V_traj", num(s.v_traj)),
      fact("staleness", "staleness", num(s.staleness)),
      fact("eta", "η", d.run.eta),
      fact("length", "response tokens", s.n_tokens),
      fact("turns", "turns", d.turns),
      fact("attempt", "attempts", s.attempt),
      fact("finish", "finish", s.finish_reason || "–"),
    ].join("") + (s.reason || s.group_reason ? fact("reason", "dropped", s.reason || s.group_reason) : "");
    const metrics = Object.entries(s.reward_metrics || {})
      .map(([k, v]) => `<span data-metric="${esc(k)}">${esc(k)} ${num(v, 3)}</span>`)
      .join(" ");
    const scorer = s.scorer_token_id === null ? "" : `scored by token ${s.scorer_token_id}` +
      (s.scorer_name ? ` “${s.scorer_name}”` : "") + (s.scorer_role ? ` (${s.scorer_role})` : "");
    $("#reward").innerHTML =
      s.reward === null
        ? '<p class="empty">no reward</p>'
        : `<p class="reward">reward <b data-k="reward">${num(s.reward, 3)}</b> <span data-k="scorer">${esc(scorer)}</span>` +
          ` <span class="muted">attempt ${s.reward_attempt}</span> ${metrics}</p>`;
    $("#decoding").textContent = `(${d.decoding_note})`;
    $("#legend").innerHTML =
      d.versions.map((v) => `<span data-version="${v}"><i style="background:${colour(v)}"></i>version ${v}</span>`).join("") +
      '<span data-version="observation"><i class="observation"></i>observation</span>';
    $("#prompt").textContent = d.prompt.text !== null ? d.prompt.text : d.prompt.tokens.join(" ");
    $("#turn-count").textContent = `(${d.turns} turn${d.turns === 1 ? "" : "s"}, ${d.segments.length} segments)`;
    $("#turns").innerHTML = turnsHtml(d.segments) || '<p class="empty">nothing generated yet</p>';
    $("#timeline").innerHTML = d.timeline
      .map(
        (e) =>
          `<li class="${esc(e.class)}" data-kind="${esc(e.kind)}"><time>${esc(String(e.at).slice(11, 23))}</time> ${esc(e.text)}</li>`,
      )
      .join("");
    document.body.dataset.loaded = String(Date.now());
  }

  if (SF.page === "list") list();
  else one();
})();
