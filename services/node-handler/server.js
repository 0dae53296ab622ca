// A Rebound push handler written in Node (no dependencies: node's own http module), the proof that a service in any
// language can sit behind Rebound run as a consumer proxy (REBOUND_HANDLER=http://host:port/events).
//
//   node services/node-handler/server.js [--port P] [--host H]
//
// It prints one JSON line {"listening": <port>} once it accepts calls (--port 0, the default, picks a free port).
// Every POST is one delivery of a Kafka record in the request format of docs/push-handlers.md: the body is the
// record's value, bytes unchanged (empty with Rebound-Value-Null: 1 for a null value); the key is Rebound-Key in
// base64 (Rebound-Key-Null: 1 for a null key); the record's own headers are Rebound-Header-List, a JSON array of
// [name, base64 value] pairs in the record's order, a name possibly more than once (null for a null value); topic,
// partition, offset, attempt, tier and first receipt come as Rebound-* text; Idempotency-Key is the same on every
// delivery and retry of one record.
//
// What it answers is scripted by the record's value, when that is a JSON object, so a test decides per message:
//   {"fail_until": N, "fail_status": S, "retry_after": "R"}  answer S (default 503), with Retry-After: R when given,
//                                                           while Rebound-Attempt < N; then 200
//   {"status": S}                                           always answer S (e.g. 422: a permanent failure)
// Anything else, including a value that is not JSON, is answered 200. A request whose Rebound-Header-List is missing
// or does not decode as documented is answered 400 "malformed Rebound-Header-List: <why>", whatever its value says.
//
// GET /calls returns every delivery it received, in order, as a JSON array (the decoded key, value and headers in
// base64, the Rebound-* fields, the Idempotency-Key, when it arrived and answered, and its answer), so a test checks
// what Rebound sent from what the service recorded. POST /reset forgets them.

"use strict";

const http = require("node:http");

const calls = [];

function argument(name, fallback) {
  const index = process.argv.indexOf(name);
  return index >= 0 && index + 1 < process.argv.length ? process.argv[index + 1] : fallback;
}

function header(request, name) {
  const value = request.headers[name.toLowerCase()];
  return value === undefined ? null : value;
}

// The record's headers as a Node service works with them: [name, Buffer or null] pairs, in the record's order,
// repeated names kept. Throws, saying what is wrong, on anything else than the documented format.
function recordHeaders(text) {
  if (text === null) throw new Error("no Rebound-Header-List");
  let parsed;
  try {
    parsed = JSON.parse(text);
  } catch (error) {
    throw new Error(`Rebound-Header-List is not JSON (${error.message})`);
  }
  if (!Array.isArray(parsed)) throw new Error("Rebound-Header-List is not a JSON array");
  return parsed.map((pair) => {
    if (!Array.isArray(pair) || pair.length !== 2 || typeof pair[0] !== "string") {
      throw new Error(`not a [name, value] pair: ${JSON.stringify(pair).slice(0, 200)}`);
    }
    const [name, value] = pair;
    if (value === null) return [name, null];
    // Buffer.from skips what is not base64 and reads unpadded text: only a value that re-encodes to itself is one.
    const bytes = typeof value === "string" ? Buffer.from(value, "base64") : null;
    if (bytes === null || bytes.toString("base64") !== value) {
      throw new Error(`header ${JSON.stringify(name).slice(0, 100)}: not canonical base64`);
    }
    return [name, bytes];
  });
}

function script(body, valueIsNull) {
  if (valueIsNull || body.length === 0) return {};
  try {
    const parsed = JSON.parse(body.toString("utf8"));
    return parsed !== null && typeof parsed === "object" && !Array.isArray(parsed) ? parsed : {};
  } catch {
    return {};
  }
}

function decide(plan, attempt) {
  if (Number.isInteger(plan.status)) return { status: plan.status };
  if (Number.isInteger(plan.fail_until) && attempt < plan.fail_until) {
    return { status: Number.isInteger(plan.fail_status) ? plan.fail_status : 503, retryAfter: plan.retry_after };
  }
  return { status: 200 };
}

function deliver(request, response, body) {
  const receivedAt = Date.now();
  const attempt = Number.parseInt(header(request, "Rebound-Attempt") ?? "", 10);
  const valueIsNull = header(request, "Rebound-Value-Null") === "1";
  const keyIsNull = header(request, "Rebound-Key-Null") === "1";
  const key = header(request, "Rebound-Key");
  let headers;
  let answer;
  try {
    // Re-encoded from the decoded Buffers for GET /calls: what Node itself read, not the header's text.
    headers = recordHeaders(header(request, "Rebound-Header-List")).map(([name, value]) => [
      name,
      value === null ? null : value.toString("base64"),
    ]);
    answer = decide(script(body, valueIsNull), attempt);
  } catch (error) {
    // Not a delivery it can read: 400 saying why, whatever the value's script asks (recorded all the same).
    headers = { error: error.message };
    answer = { status: 400, text: `malformed Rebound-Header-List: ${error.message}` };
  }
  const call = {
    path: request.url,
    idempotency_key: header(request, "Idempotency-Key"),
    attempt,
    tier: header(request, "Rebound-Tier"),
    topic: header(request, "Rebound-Topic"),
    partition: Number.parseInt(header(request, "Rebound-Partition") ?? "", 10),
    offset: Number.parseInt(header(request, "Rebound-Offset") ?? "", 10),
    first_received_at: header(request, "Rebound-First-Received-At"),
    content_type: header(request, "Content-Type"),
    authorization: header(request, "Authorization"),
    key_null: keyIsNull,
    // Round-tripped through a Buffer: what a Node service would really work with, not the header text.
    key: key === null ? null : Buffer.from(key, "base64").toString("base64"),
    value_null: valueIsNull,
    value: body.toString("base64"),
    headers,
    received_at: receivedAt,
    status: answer.status,
  };
  const extra = { "Content-Type": "text/plain" };
  if (answer.retryAfter !== undefined) extra["Retry-After"] = String(answer.retryAfter);
  call.answered_at = Date.now();
  calls.push(call);
  const text =
    answer.text ?? (answer.status < 300 ? "ok" : `node-handler: status ${answer.status} for attempt ${attempt}`);
  response.writeHead(answer.status, extra);
  response.end(text);
}

const server = http.createServer((request, response) => {
  const chunks = [];
  request.on("data", (chunk) => chunks.push(chunk));
  request.on("end", () => {
    const body = Buffer.concat(chunks);
    if (request.method === "GET" && request.url === "/calls") {
      response.writeHead(200, { "Content-Type": "application/json" });
      response.end(JSON.stringify(calls));
    } else if (request.method === "POST" && request.url === "/reset") {
      calls.length = 0;
      response.writeHead(200, { "Content-Type": "text/plain" });
      response.end("reset");
    } else if (request.method === "POST") {
      deliver(request, response, body);
    } else {
      response.writeHead(405, { Allow: "POST" });
      response.end();
    }
  });
});

server.keepAliveTimeout = 60_000; // longer than a client pool's idle time: Rebound's keep-alive connections stay
server.listen(Number.parseInt(argument("--port", "0"), 10), argument("--host", "127.0.0.1"), () => {
  process.stdout.write(JSON.stringify({ listening: server.address().port }) + "\n");
});

for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => server.close(() => process.exit(0)));
}
