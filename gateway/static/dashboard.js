// The Conveyor dashboard: polls /dashboard/api/* and writes every value with textContent
// (never innerHTML: each value is producer input). No library, no build step.
"use strict";

const KEY_STORE = "conveyor-dashboard-key";
const OVERVIEW_MS = 1500, DEAD_MS = 3000, BATCHES_MS = 5000, JOB_MS = 2000;
const state = {
  ns: "", deadBefore: null, deadNext: null, mayAct: false, stopped: false,
  list: "queued", listAt: null, listNext: null, jobId: null,
};

function $(id) { return document.getElementById(id); }

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.appendChild(cell instanceof Node ? wrap(cell) : el("td", cell));
  return tr;
}

function wrap(node) { const td = document.createElement("td"); td.appendChild(node); return td; }

function fill(tbodyId, rows, empty) {
  const body = $(tbodyId);
  if (!rows.length) { const tr = row([el("span", empty, "muted")]); body.replaceChildren(tr); return; }
  body.replaceChildren(...rows);
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 60) return value.toFixed(1) + " s";
  if (value < 3600) return (value / 60).toFixed(1) + " min";
  return (value / 3600).toFixed(1) + " h";
}

function when(epoch) { return epoch ? new Date(epoch * 1000).toLocaleString() : "–"; }
function num(value, digits) { return value === null || value === undefined ? "–" : Number(value).toFixed(digits || 0); }

async function api(path, options) {
  const headers = Object.assign({}, (options && options.headers) || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["Authorization"] = "Bearer " + key;
  const query = state.ns ? (path.includes("?") ? "&" : "?") + "ns=" + encodeURIComponent(state.ns) : "";
  const response = await fetch(path + query, Object.assign({}, options, { headers, cache: "no-store" }));
  if (response.status === 401) { askForKey("a key is needed"); throw new Error("unauthorized"); }
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function askForKey(message) {
  state.stopped = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message;
}

// ---------------------------------------------------------------- overview

async function refreshOverview() {
  const data = await api("/dashboard/api/overview");
  state.mayAct = data.may_act;
  showNamespaces(data.namespace, data.namespaces);
  $("queued-total").textContent = data.totals.queued;
  $("waiting-total").textContent = data.totals.waiting;
  $("running-total").textContent = data.totals.running;
  $("dead-total").textContent = data.totals.dead_letters;
  $("replicas-live").textContent = data.totals.replicas_live;
  fill("queues", data.queues.map(q => row([
    q.model || "(any model)", q.priority_class, q.partition, q.queued, q.in_flight,
    q.queued ? seconds(q.oldest_age_s) : "–", q.consumers, num(q.done_per_s, 2),
  ])), "no request stream holds or serves anything yet");
  fill("tenants", data.tenants_today.map(t => row([
    t.namespace, t.model, t.jobs, t.prompt_tokens, t.completion_tokens, t.cached_tokens,
  ])), "no job has finished today (UTC)");
  fill("replicas", data.replicas.map(r => row([
    r.consumer, r.model, el("span", r.state, r.live ? "live" : "gone"), num(r.running), num(r.waiting),
    r.kv_usage === null ? "–" : (100 * r.kv_usage).toFixed(1) + " %", num(r.tokens_per_s, 1), num(r.finished),
    seconds(r.last_seen_s) + " ago",
  ])), "no replica has written a record here");
  drawChart(data.throughput);
  $("dead-requeue-all").hidden = !state.mayAct;
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function showNamespaces(current, namespaces) {
  $("ns-name").textContent = namespaces.length > 1 ? "" : current;
  const select = $("ns");
  $("ns-box").hidden = namespaces.length <= 1;
  if (select.options.length !== namespaces.length) {
    select.replaceChildren(...namespaces.map(ns => { const o = el("option", ns); o.value = ns; return o; }));
  }
  select.value = current;
  state.ns = current;
}

function drawChart(series) {
  const svg = $("chart"), width = 600, height = 120, span = 300;
  const lines = [["done", series.done_per_s], ["tokens", series.tokens_per_s]];
  const paths = [];
  for (const [name, values] of lines) {
    const top = Math.max(1e-9, ...values);
    const points = values.map((v, i) => {
      const x = width - (series.seconds_ago[i] / span) * width;
      const y = height - 4 - (v / top) * (height - 8);
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", name);
    paths.push(line);
  }
  svg.replaceChildren(...paths);
  const last = values => values.length ? values[values.length - 1] : null;
  $("done-now").textContent = num(last(series.done_per_s), 2);
  $("tokens-now").textContent = num(last(series.tokens_per_s), 1);
}

// ---------------------------------------------------------------- dead letters

async function refreshDead() {
  const path = "/dashboard/api/dead" + (state.deadBefore ? "?before=" + encodeURIComponent(state.deadBefore) : "");
  const data = await api(path);
  state.deadNext = data.next;
  $("dead-older").disabled = !data.next;
  $("dead-total").textContent = data.total;
  fill("dead", data.letters.map(d => row([
    d.dead_id, when(d.at), d.job_id || (d.raw_job_id ? "invalid id: " + d.raw_job_id : "?"), d.stream, d.reason, requeueButton(d),
  ])), state.deadBefore ? "no older dead letters" : "no dead letters");
}

function requeueButton(letter) {
  if (!letter.requeueable) return el("span", letter.why_not || "cannot be requeued", "muted");
  if (!state.mayAct) return el("span", "requeueable (admin key)", "muted");
  const button = el("button", "Requeue", "act");
  button.type = "button";
  button.dataset.deadId = letter.dead_id;
  button.addEventListener("click", () => requeue({ ids: [letter.dead_id] }));
  return button;
}

async function requeue(body) {
  try {
    const result = await api("/dashboard/api/dead/requeue", {
      method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "X-Conveyor-Dashboard": "1" },
    });
    const failed = result.failed.length ? `, ${result.failed.length} failed: ${result.failed[0].why}` : "";
    $("dead-note").textContent = `requeued ${result.requeued}, skipped ${result.skipped}${failed}`;
  } catch (error) {
    $("dead-note").textContent = "requeue failed: " + error.message;
  }
  await refreshDead();
}

// ---------------------------------------------------------------- batches and jobs

async function refreshBatches() {
  const data = await api("/dashboard/api/batches");
  fill("batches", data.batches.map(b => {
    const counts = b.request_counts, done = counts.completed + counts.failed;
    const bar = el("progress");
    bar.max = Math.max(counts.total, 1);
    bar.value = done;
    const progress = el("span");
    progress.append(bar, el("span", ` ${done} / ${counts.total}` + (counts.failed ? ` (${counts.failed} failed)` : "")));
    return row([b.id, b.status, b.model || "–", progress, when(b.created_at)]);
  }), data.error || "no batches");
}

function lookUpJob(event) {
  event.preventDefault();
  const id = $("job-input").value.trim();
  if (id) location.hash = "#job/" + encodeURIComponent(id);
}

// ---------------------------------------------------------------- lists of jobs

const LISTS = {  // tab -> its columns and where its pages come from
  queued: { head: ["job", "status", "attempt", "updated"] },
  running: { head: ["job", "status", "attempt", "updated"] },
  done: { head: ["job", "status", "attempt", "updated"] },
  failed: { head: ["job", "status", "attempt", "updated"] },
  dead: { head: ["dead letter", "when", "job", "reason"] },
  webhooks: { head: ["dead letter", "event", "type", "created", "data id", "detail"] },
};

function jobLink(id) {
  const link = el("a", id);
  link.href = "#job/" + encodeURIComponent(id);
  return link;
}

function listPath(kind, at) {
  if (kind === "dead") return "/dashboard/api/dead?count=50" + (at ? "&before=" + encodeURIComponent(at) : "");
  if (kind === "webhooks") return "/dashboard/api/webhooks/dead" + (at ? "?before=" + encodeURIComponent(at) : "");
  return "/dashboard/api/jobs?state=" + kind + (at ? "&cursor=" + encodeURIComponent(at) : "");
}

function listRows(kind, data) {
  if (kind === "dead") return data.letters.map(d => row([
    d.dead_id, when(d.at), d.job_id ? jobLink(d.job_id) : (d.raw_job_id ? "invalid id: " + d.raw_job_id : "?"), d.reason,
  ]));
  if (kind === "webhooks") return data.letters.map(w => row([
    w.dead_id, w.event_id, w.type, when(w.created_at), w.job_id ? jobLink(w.job_id) : w.data_id, w.detail,
  ]));
  return data.jobs.map(j => row([jobLink(j.job_id), j.status, j.attempt, when(Number(j.updated) || 0)]));
}

async function showList(kind, at) {
  state.list = kind;
  state.listAt = at || null;
  for (const tab of document.querySelectorAll("#job-tabs button")) tab.classList.toggle("chosen", tab.dataset.state === kind);
  const head = document.createElement("tr");
  for (const name of LISTS[kind].head) head.appendChild(el("th", name));
  $("job-list-head").replaceChildren(head);
  try {
    const data = await api(listPath(kind, at));
    state.listNext = data.next;
    $("jobs-next").disabled = !data.next;
    const rows = listRows(kind, data);
    fill("job-list", rows, at ? "nothing more" : "none");
    $("jobs-note").textContent = `${rows.length} shown` + (data.next ? ", more on the next page" : "");
  } catch (error) {
    $("jobs-note").textContent = "error: " + error.message;
  }
}

// ---------------------------------------------------------------- one job

function route() {
  const match = location.hash.match(/^#job\/(.+)$/);
  state.jobId = match ? decodeURIComponent(match[1]) : null;
  $("overview").hidden = Boolean(state.jobId);
  $("job-view").hidden = !state.jobId;
  if (state.jobId) {
    $("job-title").textContent = "Job " + state.jobId;
    $("job-note").textContent = "";
    refreshJob();
  }
}

function fact(name, value) { return row([el("span", name, "muted"), value]); }

async function refreshJob() {
  const id = state.jobId;
  if (!id) return;
  let job;
  try {
    job = await api("/dashboard/api/jobs/" + encodeURIComponent(id));
  } catch (error) {
    if (id !== state.jobId) return;
    $("job-error").textContent = error.message;
    for (const part of ["job-facts", "job-attempts", "job-dead"]) $(part).replaceChildren();
    for (const part of ["job-prompt", "job-output", "job-prompt-source"]) $(part).textContent = "";
    $("job-cancel").hidden = $("job-retry").hidden = true;
    return;
  }
  if (id !== state.jobId) return;  // the page moved on meanwhile
  showJob(job);
}

function showJob(job) {
  $("job-error").textContent = job.error || "";
  const timings = job.timings || {}, usage = job.usage || {};
  $("job-facts").replaceChildren(
    fact("status", el("span", job.status, "status-" + job.status)),
    fact("attempt", job.attempt ?? "–"),
    fact("updated", when(job.updated)),
    fact("cancel requested", job.cancel_requested ? "yes" : "no"),
    fact("finish reason", job.finish_reason || "–"),
    fact("timings", `queue ${seconds(timings.queue)}, ttft ${seconds(timings.ttft)}, ` +
      `tpot ${seconds(timings.tpot)}, e2e ${seconds(timings.e2e)}`),
    fact("usage", `prompt ${usage.prompt_tokens ?? "–"}, completion ${usage.completion_tokens ?? "–"}, ` +
      `cached ${usage.cached_tokens ?? "–"}`),
  );
  $("job-prompt").textContent = job.prompt || (job.status === "queued" ? "(queued: prompt not found)" : "–");
  $("job-prompt-source").textContent = job.prompt_source ? "(" + job.prompt_source + ")" : "";
  $("job-output").textContent = job.result || "–";
  fill("job-attempts", (job.attempts || []).map(a => row([
    a.attempt, a.replica || "–", when(a.started), a.trace_id || "–", a.resume || "–",
  ])), "no attempt yet");
  fill("job-dead", (job.dead_letters || []).map(d => row([
    d.dead_id, when(d.at), d.reason, d.requeueable ? "yes" : d.why_not,
  ])), "none found");
  $("job-cancel").hidden = !(job.may_act && job.cancellable);
  $("job-retry").hidden = !(job.may_act && job.retryable);
}

async function act(what) {
  const id = state.jobId;
  try {
    await api("/dashboard/api/jobs/" + encodeURIComponent(id) + "/" + what, {
      method: "POST", body: "{}", headers: { "Content-Type": "application/json", "X-Conveyor-Dashboard": "1" },
    });
    $("job-note").textContent = what === "cancel" ? "cancel requested" : "requeued";
  } catch (error) {
    $("job-note").textContent = what + " failed: " + error.message;
  }
  await refreshJob();
}

// ---------------------------------------------------------------- loop

function every(ms, work) {
  const tick = async () => {
    if (state.stopped) return;
    try { await work(); } catch (error) { if (!state.stopped) $("updated").textContent = "error: " + error.message; }
    setTimeout(tick, ms);
  };
  tick();
}

function start() {
  state.stopped = false;
  $("key-form").hidden = true;
  every(OVERVIEW_MS, refreshOverview);
  every(DEAD_MS, refreshDead);
  every(BATCHES_MS, refreshBatches);
  every(JOB_MS, refreshJob);
  showList(state.list, null);
  route();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", event => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    start();
  });
  $("ns").addEventListener("change", () => {
    state.ns = $("ns").value;
    state.deadBefore = null;
    refreshOverview(); refreshDead(); refreshBatches(); showList(state.list, null); refreshJob();
  });
  $("dead-newest").addEventListener("click", () => { state.deadBefore = null; refreshDead(); });
  $("dead-older").addEventListener("click", () => { state.deadBefore = state.deadNext; refreshDead(); });
  $("dead-requeue-all").addEventListener("click", () => requeue({ all: true }));
  $("job-form").addEventListener("submit", lookUpJob);
  for (const tab of document.querySelectorAll("#job-tabs button")) {
    tab.addEventListener("click", () => showList(tab.dataset.state, null));
  }
  $("jobs-first").addEventListener("click", () => showList(state.list, null));
  $("jobs-next").addEventListener("click", () => showList(state.list, state.listNext));
  $("job-cancel").addEventListener("click", () => act("cancel"));
  $("job-retry").addEventListener("click", () => act("retry"));
  window.addEventListener("hashchange", route);
  start();
});
