// brood's dashboard: fetches each page's body from /ui with the server's token in the
// Authorization header, wires its buttons and forms to the JSON API under /v1, and draws
// the live tree from GET /v1/runs/{id}/tree/live. Everything shown comes from the server
// already escaped, or is set as text here.
//
// The token comes once in the login URL brood serve prints (?token=...), which is taken out
// of the address bar at once, or from the form. It is kept in localStorage under this
// server's origin, so a reload or a new tab does not ask again (sessionStorage is one tab's
// only), and forgotten when the server refuses it. It is never a cookie: a browser would
// send a cookie with another site's requests too.
"use strict";

const TERMINAL = new Set(["completed", "failed", "cancelled", "timed_out"]);
const KIDS_PAGE = 50; // children an open node shows before "show more"
const AUTO_OPEN = 300; // a tree this small opens whole; a bigger one opens its root only

const TOKEN_KEY = "brood-token " + location.origin;

const S = {
  token: null,
  waiters: [], // calls waiting for the token
  page: null, // AbortController of the page shown: its streams and timers stop with it
};

// ---- the token --------------------------------------------------------------------------
function keepToken(token) {
  S.token = token || null;
  try {
    if (S.token) localStorage.setItem(TOKEN_KEY, S.token);
    else localStorage.removeItem(TOKEN_KEY);
  } catch (_) {} // storage refused (a private window): the token lives in this page only
}

function storedToken() {
  try {
    return localStorage.getItem(TOKEN_KEY);
  } catch (_) {
    return null;
  }
}

// The login URL's token is taken once and removed from the address bar (and so from the
// history, bookmarks and the screen), whatever else the address holds.
function takeToken() {
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given !== null) {
    url.searchParams.delete("token");
    history.replaceState(history.state, "", url.pathname + url.search + url.hash);
    if (given.trim()) keepToken(given.trim());
  }
  if (!S.token) S.token = storedToken();
}

function tokenGiven(token) {
  keepToken(token);
  document.getElementById("token-form").hidden = true;
  S.waiters.splice(0).forEach((resolve) => resolve());
}

// ---- calls ------------------------------------------------------------------------------
function withToken(headers) {
  const h = Object.assign({}, headers || {});
  if (S.token) h.Authorization = "Bearer " + S.token;
  return h;
}

function tokenNeeded() {
  const form = document.getElementById("token-form");
  if (S.token) return Promise.resolve(); // a newer token came meanwhile: try it
  form.hidden = false;
  form.querySelector("input").focus();
  return new Promise((resolve) => S.waiters.push(resolve));
}

async function call(url, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    const sent = S.token;
    opts.headers = withToken(opts.headers);
    const res = await fetch(url, opts);
    if (res.status === 401) {
      if (S.token === sent) keepToken(null); // forget the refused token, not a newer one
      await tokenNeeded();
      continue;
    }
    if (!res.ok) {
      let message = res.status + " " + res.statusText;
      try {
        const e = (await res.json()).error;
        message = e.message + (e.fix ? " (" + e.fix + ")" : "");
      } catch (_) {}
      throw new Error(message);
    }
    return res;
  }
}

async function post(url, body) {
  const res = await call(url, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body || {}),
  });
  return res.json();
}

function say(text, bad) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = "status" + (bad ? " bad" : "");
  clearTimeout(say.timer);
  say.timer = setTimeout(() => (el.textContent = ""), bad ? 12000 : 4000);
}

function pause(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

// Server-Sent Events over fetch (an EventSource cannot send the token): calls onEvent with
// {event, data, id} until it returns false or the page goes; reconnects after a drop.
async function follow(url, onEvent, signal) {
  let last = null;
  while (!signal.aborted) {
    try {
      const headers = { Accept: "text/event-stream" };
      if (last !== null) headers["Last-Event-ID"] = last;
      const res = await call(url, { headers, signal });
      const reader = res.body.getReader();
      const text = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += text.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const ev = { event: "message", data: null, id: null };
          for (const line of buf.slice(0, cut).split("\n")) {
            const colon = line.indexOf(":");
            if (colon <= 0) continue; // a comment (a ping) or a blank
            const field = line.slice(0, colon);
            const val = line.slice(colon + 1).replace(/^ /, "");
            if (field === "data") ev.data = ev.data === null ? val : ev.data + "\n" + val;
            else if (field === "event") ev.event = val;
            else if (field === "id") ev.id = val;
          }
          buf = buf.slice(cut + 2);
          if (ev.id !== null) last = ev.id;
          if (ev.data !== null && onEvent(ev) === false) {
            reader.cancel().catch(() => {});
            return;
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      say("lost the live stream (" + err.message + "); reconnecting", true);
    }
    await pause(1000, signal);
  }
}

// ---- pages ------------------------------------------------------------------------------
function go(path, push) {
  if (push) history.pushState(null, "", path);
  show();
}

async function show() {
  if (S.page) S.page.abort();
  const page = (S.page = new AbortController());
  const main = document.getElementById("main");
  const path = location.pathname === "/" ? "/runs" + location.search : location.pathname + location.search;
  try {
    const res = await call("/ui" + path, { signal: page.signal });
    const html = await res.text();
    if (page.signal.aborted) return;
    main.innerHTML = html; // rendered by the server with every value escaped
  } catch (err) {
    if (page.signal.aborted) return;
    main.textContent = "";
    const p = document.createElement("p");
    p.className = "error";
    p.textContent = err.message;
    main.append(p);
    return;
  }
  const section = main.querySelector(".page");
  document.title = "brood · " + (section ? section.dataset.title : "");
  wire(main, page.signal);
}

// Reloads the page's body in place (a list that refreshes, a run that ended), unless the
// person is typing into it (or `force`: what they typed was just sent).
async function refresh(signal, force) {
  const main = document.getElementById("main");
  const busy = [...main.querySelectorAll("input, textarea")].some(
    (el) => el === document.activeElement || el.value
  );
  if ((busy && !force) || signal.aborted) return;
  const opened = [...main.querySelectorAll("details")].flatMap((d, i) => (d.open ? [i] : []));
  const scroll = window.scrollY;
  await show();
  const details = document.getElementById("main").querySelectorAll("details");
  for (const i of opened) if (details[i]) details[i].open = true;
  window.scrollTo(0, scroll);
}

function wire(root, signal) {
  for (const el of root.querySelectorAll("[data-post]")) {
    const form = el.tagName === "FORM";
    el.addEventListener(form ? "submit" : "click", (e) => act(e, el, form));
  }
  const page = root.querySelector(".page");
  if (page && page.dataset.refresh) {
    const every = Number(page.dataset.refresh);
    (async () => {
      await pause(every, signal);
      if (!signal.aborted) refresh(signal);
    })();
  }
  const tree = root.querySelector("[data-live-tree]");
  if (tree) new LiveTree(tree, page, signal).start();
  countAsks(signal);
}

async function countAsks(signal) {
  try {
    const res = await call("/v1/asks", { signal });
    const n = (await res.json()).asks.length;
    document.getElementById("asks-count").textContent = n ? String(n) : "";
  } catch (_) {}
}

async function act(e, el, form) {
  e.preventDefault();
  const url = el.dataset.post;
  const body = {};
  if (form) {
    for (const f of el.querySelectorAll("input, textarea")) {
      if (f.name && f.value.trim()) body[f.name] = f.value;
    }
    if (e.submitter && e.submitter.name) body[e.submitter.name] = e.submitter.value;
  }
  const buttons = form ? [...el.querySelectorAll("button")] : [el];
  const labels = buttons.map((b) => b.textContent);
  for (const b of buttons) b.disabled = true;
  if (el.dataset.busy) el.textContent = el.dataset.busy;
  try {
    const result = await post(url, body);
    const then = el.dataset.then;
    if (then === "run") return go("/runs/" + result.run_id, true);
    if (then === "sent") {
      say("sent to " + result.run_id);
      el.reset();
    } else if (result.state) {
      say(url.split("/").slice(-2).join(" ") + ": " + result.state);
    } else {
      say("done");
    }
    await refresh(S.page.signal, true);
  } catch (err) {
    say(err.message, true);
  } finally {
    buttons.forEach((b, i) => {
      b.disabled = false;
      if (el.dataset.busy) b.textContent = labels[i];
    });
  }
}

// ---- the live tree ----------------------------------------------------------------------
function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  return m < 120 ? m + " min " + String(Math.floor(s % 60)).padStart(2, "0") + " s"
    : Math.floor(m / 60) + " h " + String(m % 60).padStart(2, "0") + " min";
}

function span(cls, text) {
  const el = document.createElement("span");
  el.className = cls;
  el.textContent = text;
  return el;
}

class LiveTree {
  constructor(el, page, signal) {
    this.el = el;
    this.runId = el.dataset.liveTree;
    this.page = page;
    this.signal = signal;
    this.rows = new Map(); // id -> row (with .seen, when it arrived)
    this.kids = new Map(); // id -> [child ids] in creation order
    this.items = new Map(); // id -> its <li>, for the nodes drawn
    this.open = new Set([this.runId]);
    this.limit = new Map(); // id -> children shown
    this.trajectory = document.getElementById("trajectory");
    this.loading = false;
  }

  start() {
    const url = "/v1/runs/" + encodeURIComponent(this.runId) + "/tree/live";
    follow(url, (ev) => this.receive(ev), this.signal);
    const tick = setInterval(() => this.tick(), 1000);
    this.signal.addEventListener("abort", () => clearInterval(tick), { once: true });
  }

  receive(ev) {
    if (ev.event === "end") {
      this.el.classList.add("ended");
      return false;
    }
    if (ev.event !== "runs") return true;
    const batch = JSON.parse(ev.data);
    const first = this.rows.size === 0;
    const grew = new Set();
    for (const r of batch.runs) {
      r.seen = performance.now();
      const old = this.rows.get(r.id);
      this.rows.set(r.id, r);
      if (!old && r.id !== this.runId) {
        if (!this.kids.has(r.parent_id)) this.kids.set(r.parent_id, []);
        this.kids.get(r.parent_id).push(r.id);
        grew.add(r.parent_id);
      }
    }
    if (first) {
      if (this.rows.size <= AUTO_OPEN) for (const id of this.rows.keys()) this.open.add(id);
      this.el.textContent = "";
      const ul = document.createElement("ul");
      ul.className = "nodes";
      this.el.append(ul);
      if (this.rows.has(this.runId)) ul.append(this.node(this.runId));
    } else {
      for (const r of batch.runs) if (this.items.has(r.id)) this.paint(r.id);
      for (const id of grew) if (this.items.has(id)) this.paint(id);
    }
    this.summary();
    this.follow(batch);
    return true;
  }

  // The run page's own run: its header, and its trajectory as it grows.
  follow(batch) {
    const me = this.rows.get(this.runId);
    const head = document.getElementById("head");
    if (me && head) {
      const state = head.querySelector('[data-field="state"]');
      state.textContent = me.stale ? "stale" : me.state;
      state.className = "state s-" + me.state + (me.stale ? " stale" : "");
      head.querySelector('[data-field="tokens"]').textContent =
        me.tokens.toLocaleString() + " tok · " + me.calls + " calls · " + me.cost;
      head.querySelector('[data-field="subtree"]').textContent =
        me.subtree_tokens.toLocaleString() + " tok · " + me.subtree_cost;
      if (TERMINAL.has(me.state) && !TERMINAL.has(this.page.dataset.state)) {
        this.page.dataset.state = me.state;
        refresh(this.signal); // the answer and the final steps, rendered by the server
        return;
      }
    }
    const wrote = batch.wrote[this.runId];
    const t = this.trajectory;
    const born = (this.kids.get(this.runId) || []).length > Number(t.dataset.children);
    if (t && !this.loading && ((wrote && wrote > Number(t.dataset.seq)) || born)) this.more();
  }

  async more() {
    const t = this.trajectory;
    this.loading = true;
    try {
      const url = "/ui/runs/" + encodeURIComponent(this.runId) + "/trajectory?after=" +
        t.dataset.seq + "&children=" + t.dataset.children;
      const res = await call(url, { signal: this.signal });
      const box = document.createElement("div");
      box.innerHTML = await res.text(); // rendered by the server, escaped
      const tpl = box.querySelector("template");
      t.dataset.seq = tpl.dataset.seq;
      t.dataset.children = tpl.dataset.children;
      t.append(tpl.content);
      const none = document.getElementById("no-entries");
      if (none && t.children.length) none.remove();
    } catch (_) {
    } finally {
      this.loading = false;
    }
  }

  summary() {
    const counts = {};
    for (const r of this.rows.values()) counts[r.state] = (counts[r.state] || 0) + 1;
    const parts = Object.entries(counts).map(([s, n]) => n + " " + s);
    const el = document.getElementById("tree-summary");
    if (el) el.textContent = this.rows.size + " runs · " + parts.join(" · ");
  }

  node(id) {
    const li = document.createElement("li");
    li.dataset.run = id;
    this.items.set(id, li);
    this.paint(id);
    return li;
  }

  forget(li) {
    for (const sub of li.querySelectorAll("li[data-run]")) this.items.delete(sub.dataset.run);
  }

  paint(id) {
    const r = this.rows.get(id);
    const li = this.items.get(id);
    const kids = this.kids.get(id) || [];
    const open = this.open.has(id);
    li.className = "node st-" + r.state + (r.stale ? " stale" : "");
    let row = li.querySelector(":scope > .row");
    if (!row) {
      row = document.createElement("div");
      row.className = "row";
      li.prepend(row);
    }
    row.textContent = "";
    const toggle = document.createElement("button");
    toggle.className = "toggle";
    toggle.disabled = kids.length === 0;
    toggle.textContent = kids.length === 0 ? "·" : open ? "▾" : "▸";
    toggle.setAttribute("aria-label", open ? "collapse" : "expand");
    toggle.addEventListener("click", () => this.toggle(id));
    const link = document.createElement("a");
    link.className = "id";
    link.href = "/runs/" + id;
    link.textContent = id;
    row.append(toggle, link, span("state s-" + r.state, r.stale ? "stale" : r.state));
    if (r.attempt) row.append(span("tag", "attempt " + (r.attempt + 1)));
    if (r.waiting_for.length) row.append(span("pill waiting", "waiting for a person"));
    if (r.hibernating) row.append(span("pill hibernating", "hibernating"));
    row.append(span("depth", "d" + r.depth), span("dur", seconds(this.duration(r))),
      span("tok", r.tokens.toLocaleString() + " tok"));
    if (kids.length && !open) {
      const live = kids.filter((k) => !TERMINAL.has(this.rows.get(k).state)).length;
      row.append(span("kids", kids.length + " children" + (live ? " · " + live + " open" : "")));
    }
    const what = span("what", r.prompt);
    if (r.key) what.title = "key " + r.key;
    row.append(what);
    if (r.last_line && !TERMINAL.has(r.state)) row.append(span("line", "› " + r.last_line));
    if (r.reason && TERMINAL.has(r.state) && r.state !== "completed") row.append(span("reason", r.reason));
    let ul = li.querySelector(":scope > ul");
    if (!open || kids.length === 0) {
      if (ul) { this.forget(ul); ul.remove(); }
      return;
    }
    if (!ul) {
      ul = document.createElement("ul");
      ul.className = "nodes";
      li.append(ul);
    }
    const limit = this.limit.get(id) || KIDS_PAGE;
    const shown = [...ul.children].filter((c) => c.dataset.run).length;
    const more = ul.querySelector(":scope > .more");
    if (more) more.remove();
    for (const k of kids.slice(shown, limit)) ul.append(this.node(k));
    if (kids.length > limit) {
      const m = document.createElement("li");
      m.className = "more";
      const b = document.createElement("button");
      b.textContent = "show " + Math.min(KIDS_PAGE, kids.length - limit) + " more of " +
        (kids.length - limit) + " hidden children";
      b.addEventListener("click", () => {
        this.limit.set(id, limit + KIDS_PAGE);
        this.paint(id);
      });
      m.append(b);
      ul.append(m);
    }
  }

  toggle(id) {
    if (this.open.has(id)) this.open.delete(id);
    else this.open.add(id);
    this.paint(id);
  }

  duration(r) {
    if (r.duration === null) return null;
    const live = !TERMINAL.has(r.state) && !r.stale;
    return live ? r.duration + (performance.now() - r.seen) / 1000 : r.duration;
  }

  tick() {
    for (const [id, li] of this.items) {
      const r = this.rows.get(id);
      if (TERMINAL.has(r.state) || r.stale || r.duration === null) continue;
      const dur = li.querySelector(":scope > .row > .dur");
      if (dur) dur.textContent = seconds(this.duration(r));
    }
    const me = this.rows.get(this.runId);
    const head = document.querySelector('#head [data-field="duration"]');
    if (me && head) head.textContent = seconds(this.duration(me));
  }
}

// ---- start ------------------------------------------------------------------------------
document.addEventListener("click", (e) => {
  const a = e.target.closest("a[href^='/']");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  e.preventDefault();
  go(a.getAttribute("href"), true);
});
window.addEventListener("popstate", () => show());
document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = e.target.querySelector("input");
  const token = input.value.trim();
  input.value = "";
  tokenGiven(token);
});
window.addEventListener("storage", (e) => {
  // Another tab of this server was given the token: this one waits no more.
  if (e.key === TOKEN_KEY && e.newValue && S.waiters.length) tokenGiven(e.newValue);
});
takeToken();
show();
