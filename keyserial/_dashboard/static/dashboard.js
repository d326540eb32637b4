// keyserial dashboard: polls /api/overview every second and renders it. Data from Redis is
// only ever set as textContent, never as HTML: keys and messages are written by clients.
"use strict";

const REFRESH_MS = 1000;
let token = null;
let refreshFailed = false;
// Dead letters opened on the page stay open across refreshes.
const openLetters = new Set();

function readToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem("keyserial-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("keyserial-token");
}

async function api(path, method = "GET") {
  const response = await fetch(path, { method, headers: { Authorization: `Bearer ${token}` } });
  const body = await response.json();
  if (response.status === 401) {
    askForToken();
  }
  if (!response.ok) {
    throw new Error(body.error || `${response.status}`);
  }
  return body;
}

function askForToken() {
  sessionStorage.removeItem("keyserial-token");
  token = null;
  document.getElementById("token-form").hidden = false;
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (className) td.className = className;
  return td;
}

function fill(tableId, rows, render) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    render(row, tr);
    return tr;
  }));
}

function duration(ms) {
  if (ms === null || ms === undefined) return "-";
  if (ms < 1000) return `${ms}ms`;
  if (ms < 120000) return `${(ms / 1000).toFixed(1)}s`;
  return `${Math.floor(ms / 60000)}m`;
}

function hostPid(worker) {
  return worker ? `${worker.host}:${worker.pid}` : "-";
}

function shardList(shards) {
  return shards.length ? shards.join(", ") : "-";
}

function pausedKeys(shard) {
  // How many keys are paused on the shard, and the longest paused few (their ops wait).
  if (!shard.paused) return "0";
  const more = shard.paused - shard.paused_keys.length;
  return `${shard.paused}: ${shard.paused_keys.join(", ")}${more > 0 ? ` and ${more} more` : ""}`;
}

function when(ms) {
  return new Date(ms).toLocaleTimeString();
}

function say(text, bad = false) {
  const message = document.getElementById("message");
  message.textContent = text;
  message.className = bad ? "bad" : "";
}

function render(view) {
  document.getElementById("namespace").textContent = `namespace ${view.namespace}`;
  const health = document.getElementById("health");
  health.textContent = view.healthy ? "every shard has an owner" : "UNHEALTHY: a shard has no owner";
  health.className = view.healthy ? "ok" : "bad";
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  fill("shards", view.shards, (shard, tr) => {
    if (!shard.owner) tr.className = "unowned";
    tr.append(
      cell(shard.shard, "num"), cell(hostPid(shard.owner)), cell(shard.epoch, "num"),
      cell(duration(shard.lease_expires_in_ms), "num"), cell(shard.backlog, "num"),
      cell(duration(shard.oldest_waiting_age_ms), "num"), cell(shard.dead_letters, "num"),
      cell(shard.ops_per_s === null ? "-" : shard.ops_per_s.toFixed(1), "num"),
      cell(pausedKeys(shard)), cell(shard.timers, "num"),
      cell(duration(shard.next_timer_in_ms), "num"));
  });
  fill("workers", view.workers, (worker, tr) => {
    let ops = worker.ops.join(", ");
    if (worker.ops_differ_from.length) ops += ` (NOT THE SAME AS ${worker.ops_differ_from.join(", ")})`;
    const renewed = `${duration(worker.renewed_ms_ago)} ago${worker.maybe_gone ? " (gone?)" : ""}`;
    tr.append(cell(hostPid(worker)), cell(shardList(worker.owns)), cell(shardList(worker.standby)),
      cell(ops), cell(renewed, worker.maybe_gone ? "bad" : undefined));
  });
  fill("hot", view.hot_keys, (hot, tr) => {
    tr.append(cell(hot.key), cell(hot.ops_per_s.toFixed(1), "num"));
  });
  fill("failed", view.failed, (op, tr) => {
    tr.append(cell(when(op.at)), cell(op.keys.join(", ")), cell(op.op), cell(op.error), cell(op.id));
  });
  fill("letters", view.dead_letters, (letter, tr) => {
    const actions = document.createElement("td");
    actions.append(
      button("Replay", () => replay(letter, false)),
      button("Replay as new ops", () => replay(letter, true)),
      button("Drop", () => drop(letter)));
    tr.append(cell(letter.shard, "num"), cell(letter.id), letterCell(letter), cell(letter.reason),
      actions);
  });
}

function letterCell(letter) {
  // Its op ids; opened, what it holds (the envelope, or the entry as it was written).
  const td = document.createElement("td");
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = letter.op_ids.join(", ") || "(no op id)";
  const raw = document.createElement("pre");
  try {
    raw.textContent = JSON.stringify(JSON.parse(letter.raw), null, 2);
  } catch {
    raw.textContent = letter.raw;
  }
  details.append(summary, raw);
  const id = `${letter.shard}/${letter.id}`;
  details.open = openLetters.has(id);
  details.addEventListener("toggle", () => {
    if (details.open) openLetters.add(id);
    else openLetters.delete(id);
  });
  td.append(details);
  return td;
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

async function act(path, done) {
  try {
    await done(await api(path, "POST"));
    await refresh();
  } catch (error) {
    say(`${path}: ${error.message}`, true);
  }
}

function replay(letter, newIds) {
  const path = `/api/dead-letters/${letter.shard}/${letter.id}/replay${newIds ? "?new_id=1" : ""}`;
  return act(path, (result) => {
    const ops = result.replayed.map((op) => (op.was ? `${op.was} as ${op.op_id}` : op.op_id));
    const skipped = result.skipped.length ? `; skipped: ${result.skipped.join("; ")}` : "";
    say(`replayed dead letter ${letter.id}: ${ops.join(", ") || "no op"}${skipped}`);
  });
}

function drop(letter) {
  if (!confirm(`Drop dead letter ${letter.id}? Its ops will not run.`)) return undefined;
  return act(`/api/dead-letters/${letter.shard}/${letter.id}/drop`,
    () => say(`dropped dead letter ${letter.id}`));
}

async function inspect(key) {
  const view = await api(`/api/keys/${encodeURIComponent(key)}`);
  document.getElementById("key-view").hidden = false;
  document.getElementById("key-name").textContent = view.key;
  document.getElementById("key-shard").textContent = view.shard;
  document.getElementById("key-paused").textContent = view.paused ? "paused (its ops queue)" : "running";
  const pause = document.getElementById("key-pause");
  pause.textContent = view.paused ? "Resume" : "Pause";
  pause.onclick = () => act(`/api/keys/${encodeURIComponent(key)}/${view.paused ? "resume" : "pause"}`,
    (result) => {
      say(`${result.paused ? "paused" : "resumed"} ${result.key}`);
      return inspect(key);
    });
  const state = view.state === null ? "(no state)" : view.state + (view.state_truncated ? " …" : "");
  document.getElementById("key-state").textContent = state;
  fill("key-queued", view.queued, (op, tr) => {
    tr.append(cell(op.entry), cell(op.id), cell(op.op), cell(op.keys.join(", ")),
      cell(`${op.args} ${op.kwargs}`));
  });
  fill("key-timers", view.timers, (timer, tr) => {
    tr.append(cell(new Date(timer.due_ms).toLocaleString()), cell(timer.id),
      cell(timer.ops.map((op) => op.id).join(", ")), cell(timer.ops.map((op) => op.op).join(", ")));
  });
  fill("key-recent", view.recent, (op, tr) => {
    tr.append(cell(when(op.at)), cell(op.id), cell(op.op), outcomeCell(op.outcome));
  });
}

function outcomeCell(outcome) {
  const td = document.createElement("td");
  if (!outcome) {
    td.textContent = "(no stored outcome)";
  } else if (outcome.error) {
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.className = "bad";
    summary.textContent = `${outcome.error.type}: ${outcome.error.message}`;
    const trace = document.createElement("pre");
    trace.textContent = outcome.error.traceback || "(no traceback)";
    details.append(summary, trace);
    td.append(details);
  } else {
    td.textContent = outcome.ok;
  }
  return td;
}

async function refresh() {
  if (!token) return;
  try {
    render(await api("/api/overview"));
    if (refreshFailed) say("");
    refreshFailed = false;
  } catch (error) {
    say(error.message, true);
    refreshFailed = true;
  }
}

function start() {
  token = readToken();
  if (!token) askForToken();
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    token = document.getElementById("token-input").value.trim();
    sessionStorage.setItem("keyserial-token", token);
    document.getElementById("token-form").hidden = true;
    refresh();
  });
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("key-input").value;
    if (key) inspect(key).catch((error) => say(error.message, true));
  });
  refresh();
  setInterval(refresh, REFRESH_MS);
}

start();
