/* Rebound's dashboard script (app/web/dashboard.py serves it at /dashboard/dashboard.js). It polls the JSON views
   and draws SVG charts of the last hour; whatever it shows from the server is inserted as text (textContent),
   never as markup. */
"use strict";
var PERIOD_MS = 3000;
var HISTORY_MS = 10000;
var SVG_NS = "http://www.w3.org/2000/svg";  /* a namespace name: nothing is fetched from it */
var COLORS = ["#5b8def", "#e0663d", "#3aa655", "#9b59b6", "#d4a017", "#16a2b8", "#c0392b", "#7f8c8d"];
var SERIES_COLORS = {succeeded: "#3aa655", retried: "#d4a017", dead: "#c0392b", held: "#9b59b6"};
document.getElementById("period").textContent = PERIOD_MS / 1000;

function el(tag, text, cls) {
  var node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function svg(tag, attrs, text) {
  var node = document.createElementNS(SVG_NS, tag);
  Object.keys(attrs || {}).forEach(function (name) { node.setAttribute(name, String(attrs[name])); });
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function dur(ms) {
  if (ms === null || ms === undefined) return "-";
  var s = ms / 1000;
  if (s < 1) return Math.round(ms) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}
function when(ms) { return ms ? new Date(ms).toISOString().replace("T", " ").replace("Z", "") : "-"; }
function clock(ms, seconds) { return new Date(ms).toTimeString().slice(0, seconds ? 8 : 5); }
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
function scope() { return document.getElementById("scope-choice").value; }

/* A line chart: series of [time ms, value] points over [x0, x1]; a value of null breaks the line. */
function drawChart(box, title, series, x0, x1, format) {
  var W = 440, H = 190, L = 56, R = 10, T = 8, B = 22;
  box.replaceChildren();
  box.appendChild(el("h3", title));
  var top = 0, count = 0;
  series.forEach(function (s) {
    s.points.forEach(function (p) { if (p[1] !== null) { top = Math.max(top, p[1]); count++; } });
  });
  top = top > 0 ? top * 1.1 : 1;
  var chart = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title});
  chart.setAttribute("data-points", count);
  function x(t) { return L + (W - L - R) * (x1 > x0 ? (t - x0) / (x1 - x0) : 1); }
  function y(v) { return T + (H - T - B) * (1 - v / top); }
  for (var i = 0; i <= 4; i++) {
    var v = top * i / 4;
    chart.appendChild(svg("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eee"}));
    chart.appendChild(svg("text", {x: L - 4, y: y(v) + 4, "text-anchor": "end"}, format(v)));
  }
  var short = x1 - x0 < 600000;
  for (var j = 0; j <= 3; j++) {
    var t = x0 + (x1 - x0) * j / 3;
    chart.appendChild(svg("text", {x: x(t), y: H - 6, "text-anchor": j === 0 ? "start" : (j === 3 ? "end" : "middle")},
      clock(t, short)));
  }
  chart.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, stroke: "#999"}));
  chart.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#999"}));
  series.forEach(function (s) {
    var runs = [[]];
    s.points.forEach(function (p) {
      if (p[1] === null) { runs.push([]); return; }
      runs[runs.length - 1].push(x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1));
    });
    runs.forEach(function (run) {
      if (run.length > 1) {
        chart.appendChild(svg("polyline", {points: run.join(" "), fill: "none", stroke: s.color, "stroke-width": 1.6}));
      }
    });
    s.points.forEach(function (p) {
      if (p[1] === null) return;
      var dot = svg("circle", {cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: 2, fill: s.color});
      dot.setAttribute("class", "point");
      dot.appendChild(svg("title", {}, s.name + " " + format(p[1]) + " at " + clock(p[0], true)));
      chart.appendChild(dot);
    });
  });
  box.appendChild(chart);
  var legend = el("div", null, "legend");
  series.forEach(function (s) {
    var swatch = el("span", null, "swatch");
    swatch.style.background = s.color;
    legend.appendChild(swatch);
    var last = null;
    s.points.forEach(function (p) { if (p[1] !== null) last = p[1]; });
    legend.appendChild(el("span", s.name + (last === null ? "" : " (" + format(last) + ")")));
  });
  if (!count) legend.appendChild(el("span", " no data yet: a sample is taken every 10 s", "muted"));
  box.appendChild(legend);
}
function num(v) { return v >= 100 ? String(Math.round(v)) : String(Math.round(v * 10) / 10); }

function showHistory(data) {
  var samples = data.samples || [];
  var x1 = data.now, x0 = Math.max(data.now - data.window_ms, samples.length ? samples[0].at - data.interval_ms : data.now - 60000);
  var tiers = {};
  samples.forEach(function (s) { Object.keys(s.tiers).forEach(function (name) { tiers[name] = true; }); });
  var names = Object.keys(tiers);  /* in the order the worker lists them: the policy's (by delay) */
  function tierSeries(field, scale) {
    return names.map(function (name, i) {
      return {name: name, color: COLORS[i % COLORS.length], points: samples.map(function (s) {
        var t = s.tiers[name];
        return [s.at, t ? t[field] / scale : 0];
      })};
    });
  }
  drawChart(document.getElementById("chart-waiting"), "Waiting per tier (messages)", tierSeries("waiting", 1), x0, x1, num);
  drawChart(document.getElementById("chart-overdue"), "Oldest overdue per tier (seconds past due)",
    tierSeries("max_overdue_ms", 1000), x0, x1, num);
  var outcomes = ["succeeded", "retried", "dead"];
  if (samples.some(function (s) { return s.outcomes.held; })) outcomes.push("held");
  drawChart(document.getElementById("chart-outcomes"), "Attempt outcomes per minute", outcomes.map(function (name) {
    return {name: name, color: SERIES_COLORS[name], points: samples.map(function (s) { return [s.at, s.per_minute[name]]; })};
  }), x0, x1, num);
  var mine = data.scope === "cluster" ? " (this worker)" : "";
  drawChart(document.getElementById("chart-lag"), "Release lateness per 10 s (ms after due)", [
    {name: "mean", color: "#5b8def", points: samples.map(function (s) { return [s.at, s.lag_mean_ms]; })},
    {name: "p50" + mine, color: "#3aa655", points: samples.map(function (s) { return [s.at, s.lag_p50_ms]; })},
    {name: "p99" + mine, color: "#e0663d", points: samples.map(function (s) { return [s.at, s.lag_p99_ms]; })}
  ], x0, x1, num);
  var w = data.window || {};
  var o = w.outcomes || {};
  document.getElementById("window-summary").textContent = "Over the window: " + (o.succeeded || 0) + " succeeded, " +
    (o.retried || 0) + " retried, " + (o.dead || 0) + " dead; " + (w.released || 0) + " released, mean lateness " +
    (w.lag_mean_ms === null || w.lag_mean_ms === undefined ? "-" : dur(w.lag_mean_ms)) + ".";
  var note = data.scope === "cluster"
    ? "History: every worker's reports (" + (samples.length ? samples[samples.length - 1].sources : 0) +
      " worker(s) in the last sample), sampled by worker " + data.sampled_by
    : "History: worker " + data.sampled_by + " only";
  document.getElementById("history-note").textContent = note + "; " + samples.length + " sample(s), kept since this worker started " +
    dur(data.since_start_ms) + " ago (at most 1 h).";
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
    /* The waiting count with its bar (against the largest tier), in one cell: every column has a heading. */
    var waiting = el("span");
    waiting.appendChild(el("span", null, "bar" + (t.overdue ? " over" : "")));
    waiting.firstChild.style.width = Math.round(120 * t.waiting / most) + "px";
    waiting.appendChild(el("span", t.waiting, "count"));
    var tr = row([
      name, waiting, t.overdue, dur(t.max_overdue_ms), dur(t.next_release_in_ms),
      when(t.oldest_due), t.oldest_age_ms === null ? "-" : dur(t.oldest_age_ms)
    ], [null, "waiting", t.overdue ? "bad" : null, t.max_overdue_ms > 5000 ? "bad" : null]);
    tr.setAttribute("data-tier", name);
    body.appendChild(tr);
  });
  if (!names.length) body.appendChild(row(["no tiers", "", "", "", "", "", ""]));
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
  showConcurrency(data.concurrency);
}

/* Handler calls in flight against the limit, per worker: REBOUND_CONCURRENCY, or the adaptive limit with its range,
   its no-queue latency and whether it is probing (docs/design.md#adaptive-concurrency). The worker scope has one
   snapshot, the cluster scope one per worker. */
function showConcurrency(concurrency) {
  var workers = !concurrency ? {} : (concurrency.mode ? {"this worker": concurrency} : concurrency);
  var lines = Object.keys(workers).sort().map(function (worker) {
    var c = workers[worker];
    var text = "Handler calls " + worker + ": " + c.in_flight + " in flight, limit " + c.limit;
    if (c.mode === "auto") {
      text += " (adaptive " + c.minimum + " to " + c.maximum;
      if (c.baseline_ms !== null && c.baseline_ms !== undefined) text += ", no-queue latency " + dur(c.baseline_ms);
      text += c.probing ? ", probing)" : ")";
    } else {
      text += " (fixed)";
    }
    return text;
  });
  var box = document.getElementById("concurrency");
  box.textContent = lines.join("; ");
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

function label(labels, name) {
  var m = labels.match(new RegExp(name + '="((?:[^"\\\\]|\\\\.)*)"'));
  return m ? m[1] : "";
}
/* Outcome counters from the Prometheus text: rebound_attempts_total by outcome and reason, rebound_parked_total,
   the lateness histogram's count (or the older rebound_events_total); the lateness summed over every tier. */
function showMetrics(text) {
  var body = document.querySelector("#outcomes tbody");
  body.replaceChildren();
  var totals = {};
  var sum = null, count = null;
  function add(name, value) { totals[name] = (totals[name] || 0) + value; }
  parseMetrics(text).forEach(function (s) {
    if (s.name === "rebound_attempts_total") {
      var outcome = label(s.labels, "outcome"), reason = label(s.labels, "reason");
      add("outcome." + outcome, s.value);
      if (outcome === "dead" && reason) add("dead." + reason, s.value);
    } else if (s.name === "rebound_parked_total") {
      add("parked", s.value);
    } else if (s.name === "rebound_events_total") {
      var name = label(s.labels, "event");
      if (/^(outcome\.|dead\.|released$|parked$|admin\.)/.test(name)) add(name, s.value);
    }
    if (s.name === "rebound_release_lateness_seconds_sum" || s.name === "rebound_release_lag_seconds_sum") sum = (sum || 0) + s.value;
    if (s.name === "rebound_release_lateness_seconds_count" || s.name === "rebound_release_lag_seconds_count") count = (count || 0) + s.value;
  });
  if (count !== null && totals.released === undefined) totals.released = count;
  Object.keys(totals).sort().forEach(function (name) {
    body.appendChild(row([name, totals[name]], [null, /^dead\./.test(name) && totals[name] ? "bad" : null]));
  });
  if (!body.children.length) body.appendChild(row(["no outcomes yet", ""]));
  document.getElementById("lag").textContent = count ?
    "release lag after due: mean " + dur(Math.round(1000 * sum / count)) + " over " + count + " releases" : "";
}

function fillChoices(list, values) {
  var known = {};
  Array.prototype.forEach.call(list.children, function (o) { known[o.value] = true; });
  values.forEach(function (v) { if (!known[v]) { var o = el("option"); o.value = v; list.appendChild(o); } });
}

function showFailed(data) {
  var box = document.getElementById("failed");
  box.replaceChildren();
  var topics = data.topics || {};
  var select = document.getElementById("failed-topic");
  Object.keys(topics).forEach(function (name) {
    var t = topics[name];
    if (!Array.prototype.some.call(select.options, function (o) { return o.value === name; })) {
      var option = el("option", name);
      option.value = name;
      select.appendChild(option);
    }
    fillChoices(document.getElementById("failed-reasons"), Object.keys(t.by_reason));
    fillChoices(document.getElementById("failed-classes"), Object.keys(t.by_error_class));
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
  });
  if (!Object.keys(topics).length) box.textContent = "no failed topics";
}

/* Failed records browser: pages[i] is the cursor of page i (null: the newest). */
var browser = {pages: [null], index: 0, next: null, busy: false};
function browseQuery(cursor) {
  var params = new URLSearchParams();
  params.set("topic", document.getElementById("failed-topic").value);
  var reason = document.getElementById("failed-reason").value.trim();
  var cls = document.getElementById("failed-class").value.trim();
  var key = document.getElementById("failed-key").value;
  if (reason) params.set("reason", reason);
  if (cls) params.set("error_class", cls);
  if (key) params.set("key", key);
  if (key && document.getElementById("failed-key-base64").checked) params.set("key_encoding", "base64");
  if (cursor) params.set("before", cursor);
  params.set("limit", "20");
  return "/retry/failed?" + params.toString();
}
function browse() {
  if (browser.busy) return;
  browser.busy = true;
  var status = document.getElementById("failed-status");
  status.textContent = "Reading...";
  getJSON(browseQuery(browser.pages[browser.index])).then(function (data) {
    var body = document.querySelector("#failed-records tbody");
    body.replaceChildren();
    data.records.forEach(function (r) {
      var hd = r.headers || {};
      var cells = [
        when(r.timestamp), keyLabel(r), r.topic, r.partition + "@" + r.offset,
        hd["rebound.reason"] || "-",
        (hd["rebound.error-class"] || "") + ": " + (hd["rebound.error-message"] || "").slice(0, 200),
        hd["rebound.attempt"] || "-", (hd["rebound.original-topic"] || "-") + " " +
          (hd["rebound.original-partition"] || "") + "@" + (hd["rebound.original-offset"] || "")
      ];
      var tr = row(cells, [null, "text key", null, null, "reason", "text"]);
      if (r.key !== null) {  /* a click looks the key up, by its base64 when its text does not name it */
        tr.children[1].title = "look this key up";
        tr.children[1].addEventListener("click", function () { lookUpKey(r.key, r.key_base64); });
      }
      if (r.value !== undefined) tr.appendChild(el("td", r.value === null ? "(null)" : r.value, "text"));
      body.appendChild(tr);
    });
    browser.next = data.next_before;
    var text = "Page " + (browser.index + 1) + ": " + data.records.length + " record(s), newest first; read " +
      data.scanned + " record(s) (at most " + data.scan_limit + " per page).";
    if (data.scan_capped) text += " The read limit was reached before the page was full: press Older to search further.";
    if (!data.records.length && !data.scan_capped) text += " No matching record.";
    if (!data.next_before) text += " Nothing older.";
    status.textContent = text;
    status.className = data.scan_capped ? "bad" : "muted";
    document.getElementById("failed-older").disabled = !data.next_before;
    document.getElementById("failed-newer").disabled = browser.index === 0;
  }, function (e) {
    status.textContent = e.message;
    status.className = "bad";
  }).then(function () { browser.busy = false; });
}
document.getElementById("failed-form").addEventListener("submit", function (event) {
  event.preventDefault();
  browser.pages = [null];
  browser.index = 0;
  browse();
});
document.getElementById("failed-older").addEventListener("click", function () {
  if (!browser.next || browser.busy) return;
  browser.pages = browser.pages.slice(0, browser.index + 1);
  browser.pages.push(browser.next);
  browser.index++;
  browse();
});
document.getElementById("failed-newer").addEventListener("click", function () {
  if (browser.index === 0 || browser.busy) return;
  browser.index--;
  browse();
});

/* A record's key as shown: its text, and for a key its text does not name (key_base64 given: not UTF-8, control
   characters) that base64 too, to paste back into a key box with "base64" ticked. */
function keyLabel(r) {
  if (r.key === null) return "(null)";
  return r.key_base64 ? r.key + " (base64 " + r.key_base64 + ")" : r.key;
}

function showKey(key, status, data) {
  var box = document.getElementById("key-result");
  box.replaceChildren();
  var title = el("h3");
  title.appendChild(document.createTextNode("Key "));
  title.appendChild(el("code", key, "key"));
  if (data && data.key_base64) title.appendChild(document.createTextNode(" (base64 " + data.key_base64 + ")"));
  box.appendChild(title);
  if (status === 400) {
    box.appendChild(el("div", (data && data.error) || "Not a key name.", "bad"));
    return;
  }
  if (status === 404 || !data || !data.found) {
    box.appendChild(el("div", "No pending message for this key" + (data && data.worker ? " (asked worker " + data.worker + ")." : "."), "muted"));
    return;
  }
  var text = "Owned by worker " + data.worker + "; " + data.pending.length + " pending, attempts " + data.attempts +
    ", next due " + when(data.next_due) + ", last error " + (data.last_error_class || "-") + ": " + (data.last_error || "-");
  var moving = data.on_its_way || [];
  if (moving.length) text += "; " + moving.length + " on its way to a tier (sent, not parked yet)";
  if (data.blocked) text += "; blocked (key-ordered) by " + data.blocked_by + ", " + data.held.length + " held";
  box.appendChild(el("div", text, "key-summary"));
  var table = el("table");
  table.appendChild(row(["origin", "attempt", "tier", "due", "first received", "error"]));
  data.pending.concat(data.held).forEach(function (p) {
    table.appendChild(row([p.origin, p.attempt, p.tier || "-", when(p.due_at), when(p.first_received_at),
      (p.error_class || "") + ": " + (p.error_message || "")], [null, null, null, null, null, "text"]));
  });
  moving.forEach(function (m) {
    table.appendChild(row([m.origin, m.attempt, "on its way (" + m.state + " " + m.since_ms + " ms ago)", "-", "-", ""]));
  });
  box.appendChild(table);
}
/* A key by its text, or by the base64 of its bytes (key_encoding=base64) when an answer gave one (key_base64: the
   text does not name it). "." and ".." are sent in base64 too: a URL drops them from its path. */
function lookUpKey(key, base64) {
  if (!base64 && (key === "." || key === "..")) base64 = btoa(key);
  var path = base64 ? encodeURIComponent(base64) + "?key_encoding=base64" : encodeURIComponent(key);
  fetch("/retry/keys/" + path, {cache: "no-store"}).then(function (r) {
    return r.json().then(function (data) { showKey(key, r.status, data); }, function () { showKey(key, r.status, null); });
  }, function (e) { document.getElementById("key-result").textContent = e.message; });
}
document.getElementById("key-form").addEventListener("submit", function (event) {
  event.preventDefault();
  var key = document.getElementById("key-input").value;
  if (key) lookUpKey(key, document.getElementById("key-base64").checked ? key : null);
});

function refreshHistory() {
  getJSON("/retry/history?scope=" + scope()).then(showHistory, function (e) {
    document.getElementById("history-note").textContent = e.message;
  }).then(function () { setTimeout(refreshHistory, HISTORY_MS); });
}
document.getElementById("scope-choice").addEventListener("change", function () {
  getJSON("/retry/history?scope=" + scope()).then(showHistory, function () {});
});

var browsedOnce = false;
function refresh() {
  var errors = [];
  Promise.all([
    getJSON(scope() === "worker" ? "/retry/backlog?scope=worker" : "/retry/backlog").then(showBacklog,
      function (e) { errors.push(e.message); }),
    fetch("/metrics", {cache: "no-store"}).then(function (r) { return r.text(); }).then(showMetrics,
      function (e) { errors.push(e.message); }),
    getJSON("/retry/failed").then(showFailed, function (e) { errors.push(e.message); })
  ]).then(function () {
    document.getElementById("updated").textContent = "Updated " + new Date().toLocaleTimeString() + ".";
    document.getElementById("error").textContent = errors.join("; ");
    if (!browsedOnce) { browsedOnce = true; browse(); }
    setTimeout(refresh, PERIOD_MS);
  });
}
refresh();
refreshHistory();
