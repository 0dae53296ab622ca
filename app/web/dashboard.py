"""``GET /dashboard/``: one self-contained HTML page (no CDN, no external asset) polling the JSON views."""

from __future__ import annotations

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Rebound dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
  h1 { font-size: 1.4em; margin: 0 0 .2em; }
  h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
  table { border-collapse: collapse; background: #fff; min-width: 40em; }
  th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: right; }
  th:first-child, td:first-child { text-align: left; }
  th { background: #f0f0f0; }
  .muted { color: #777; }
  .bad { color: #b00; font-weight: 600; }
  .ok { color: #070; }
  .bar { display: inline-block; height: .8em; background: #5b8def; vertical-align: middle; }
  .bar.over { background: #e0663d; }
  code { background: #eee; padding: 0 .2em; }
  #error { color: #b00; }
</style>
</head>
<body>
<h1>Rebound</h1>
<div class="muted">Polls <code>/retry/backlog</code>, <code>/retry/failed</code> and <code>/metrics</code> every
<span id="period">3</span> s. <span id="updated"></span> <span id="error"></span></div>

<h2>Backlog per tier <span class="muted" id="scope"></span></h2>
<div id="workers" class="muted"></div>
<div id="ordering"></div>
<div id="breakers"></div>
<table id="backlog"><thead><tr>
  <th>tier</th><th>waiting</th><th>overdue</th><th>max overdue</th><th>next release in</th>
  <th>oldest due</th><th>oldest first receipt (age)</th><th></th>
</tr></thead><tbody></tbody></table>

<h2>Outcomes (this worker)</h2>
<table id="outcomes"><thead><tr><th>counter</th><th>value</th></tr></thead><tbody></tbody></table>
<div id="lag" class="muted"></div>

<h2>Failed topics</h2>
<div id="failed"></div>

<script>
"use strict";
var PERIOD_MS = 3000;
document.getElementById("period").textContent = PERIOD_MS / 1000;

function el(tag, text, cls) {
  var node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function dur(ms) {
  if (ms === null || ms === undefined) return "-";
  var s = ms / 1000;
  if (s < 1) return ms + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}
function when(ms) { return ms ? new Date(ms).toISOString().replace("T", " ").replace("Z", "") : "-"; }
function row(cells, classes) {
  var tr = el("tr");
  cells.forEach(function (cell, i) {
    var td = el("td");
    if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell;
    if (classes && classes[i]) td.className = classes[i];
    tr.appendChild(td);
  });
  return tr;
}
function getJSON(path) {
  return fetch(path, {cache: "no-store"}).then(function (r) {
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  });
}

function showBacklog(data) {
  var body = document.querySelector("#backlog tbody");
  body.replaceChildren();
  document.getElementById("scope").textContent = "(" + data.scope + ")";
  var workers = data.workers || [];
  var stale = data.stale_workers || [];
  var missing = data.partitions_missing || [];
  var text = workers.length + " worker(s) reporting";
  if (stale.length) text += ", " + stale.length + " stale: " + stale.map(function (w) { return w.worker; }).join(", ");
  if (missing.length) text += "; partitions not reported: " + missing.join(", ");
  document.getElementById("workers").textContent = data.scope === "cluster" ? text : "";
  var names = Object.keys(data.tiers || {});
  var most = 1;
  names.forEach(function (n) { most = Math.max(most, data.tiers[n].waiting); });
  names.forEach(function (name) {
    var t = data.tiers[name];
    var bar = el("span", null, "bar" + (t.overdue ? " over" : ""));
    bar.style.width = Math.round(200 * t.waiting / most) + "px";
    body.appendChild(row([
      name, t.waiting, t.overdue, dur(t.max_overdue_ms), dur(t.next_release_in_ms),
      when(t.oldest_due), t.oldest_age_ms === null ? "-" : dur(t.oldest_age_ms), bar
    ], [null, null, t.overdue ? "bad" : null, t.max_overdue_ms > 5000 ? "bad" : null]));
  });
  if (!names.length) body.appendChild(row(["no tiers", "", "", "", "", "", "", ""]));
  var ordering = data.ordering || {};
  document.getElementById("ordering").textContent = ordering.mode === "key"
    ? "Key-ordered: " + ordering.blocked_keys + " key(s) blocked, " + ordering.held + " message(s) held behind them"
    : "";
  var breakers = data.breakers || (data.breaker ? {"this worker": data.breaker} : {});
  var lines = Object.keys(breakers).map(function (worker) {
    var b = breakers[worker];
    var text = "Circuit breaker " + worker + ": " + b.state;
    if (b.state !== "closed") text += " (next probe " + when(b.next_probe_at_ms) + ", " + b.waiting_calls + " call(s) waiting)";
    return text;
  });
  var box = document.getElementById("breakers");
  box.textContent = lines.join("; ");
  box.className = lines.some(function (l) { return l.indexOf(": closed") < 0; }) ? "bad" : "muted";
}

function parseMetrics(text) {
  var out = [];
  text.split("\n").forEach(function (line) {
    if (!line || line[0] === "#") return;
    var m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$/);
    if (m) out.push({name: m[1], labels: m[2] || "", value: Number(m[3])});
  });
  return out;
}

function showMetrics(text) {
  var body = document.querySelector("#outcomes tbody");
  body.replaceChildren();
  var samples = parseMetrics(text);
  var sum = null, count = null;
  samples.forEach(function (s) {
    if (s.name === "rebound_events_total") {
      var m = s.labels.match(/event="([^"]*)"/);
      var name = m ? m[1] : s.labels;
      if (/^(outcome\.|dead\.|released$|parked$|admin\.)/.test(name)) {
        body.appendChild(row([name, s.value], [null, /^dead\./.test(name) && s.value ? "bad" : null]));
      }
    }
    if (s.name === "rebound_release_lag_seconds_sum") sum = s.value;
    if (s.name === "rebound_release_lag_seconds_count") count = s.value;
  });
  if (!body.children.length) body.appendChild(row(["no outcomes yet", ""]));
  document.getElementById("lag").textContent = count ?
    "release lag after due: mean " + dur(Math.round(1000 * sum / count)) + " over " + count + " releases" : "";
}

function showFailed(data) {
  var box = document.getElementById("failed");
  box.replaceChildren();
  var topics = data.topics || {};
  Object.keys(topics).forEach(function (name) {
    var t = topics[name];
    box.appendChild(el("h3", name + ": " + t.depth + " record(s)"));
    var info = "oldest " + when(t.oldest_record) + ", newest " + when(t.newest_record);
    if (!data.caught_up) info += " (still reading: counts are partial)";
    box.appendChild(el("div", info, "muted"));
    var counts = el("table");
    counts.appendChild(row(["by reason", "count"]));
    Object.keys(t.by_reason).forEach(function (k) { counts.appendChild(row([k, t.by_reason[k]])); });
    counts.appendChild(row(["by error class", ""]));
    Object.keys(t.by_error_class).forEach(function (k) { counts.appendChild(row([k, t.by_error_class[k]])); });
    counts.appendChild(row(["by original topic", ""]));
    Object.keys(t.by_original_topic).forEach(function (k) { counts.appendChild(row([k, t.by_original_topic[k]])); });
    box.appendChild(counts);
    if (t.latest.length) {
      var latest = el("table");
      latest.appendChild(row(["latest: key", "partition@offset", "reason", "error", "attempt", "time"]));
      t.latest.forEach(function (r) {
        var hd = r.headers || {};
        latest.appendChild(row([
          r.key === null ? "(null)" : r.key, r.partition + "@" + r.offset, hd["rebound.reason"] || "-",
          (hd["rebound.error-class"] || "") + ": " + (hd["rebound.error-message"] || "").slice(0, 120),
          hd["rebound.attempt"] || "-", when(r.timestamp)
        ]));
      });
      box.appendChild(el("div", "\u00a0"));
      box.appendChild(latest);
    }
  });
  if (!Object.keys(topics).length) box.textContent = "no failed topics";
}

function refresh() {
  var errors = [];
  Promise.all([
    getJSON("/retry/backlog").then(showBacklog, function (e) { errors.push(e.message); }),
    fetch("/metrics", {cache: "no-store"}).then(function (r) { return r.text(); }).then(showMetrics,
      function (e) { errors.push(e.message); }),
    getJSON("/retry/failed").then(showFailed, function (e) { errors.push(e.message); })
  ]).then(function () {
    document.getElementById("updated").textContent = "Updated " + new Date().toLocaleTimeString() + ".";
    document.getElementById("error").textContent = errors.join("; ");
    setTimeout(refresh, PERIOD_MS);
  });
}
refresh();
</script>
</body>
</html>
"""
