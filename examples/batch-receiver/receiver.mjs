// A receiver of keygate's batched webhook deliveries (docs/batched-deliveries.md),
// Node 18+ with no dependencies.
//
// It checks the Standard Webhooks signature once per request, handles each
// message of the batch in order, and answers each one's result: "ack" when
// handled, "retry" (with a delay) when it should come again, "dead" when it
// never can be handled. After a "retry" or "dead", keygate sends that key's
// later messages of the batch again after it, so this receiver stops handling
// a key at its first failure and answers "retry" for the rest of that key.
//
//     KEYGATE_SECRET=whsec_... node receiver.mjs 9000

import { createHmac, timingSafeEqual } from "node:crypto";
import { createServer } from "node:http";

const key = Buffer.from(process.env.KEYGATE_SECRET.replace(/^whsec_/, ""), "base64");

function signed(headers, body) {
  const id = headers["webhook-id"];
  const timestamp = headers["webhook-timestamp"];
  if (!id || !timestamp || Math.abs(Date.now() / 1000 - Number(timestamp)) > 300) return false;
  const expected = createHmac("sha256", key).update(`${id}.${timestamp}.`).update(body).digest();
  return (headers["webhook-signature"] ?? "").split(" ").some((entry) => {
    const [version, signature] = entry.split(",");
    const given = Buffer.from(signature ?? "", "base64");
    return version === "v1" && given.length === expected.length && timingSafeEqual(given, expected);
  });
}

// Your work. Return "ack", "retry" or "dead".
function handle(message) {
  if (message.data?.poison) return "dead";
  console.log(`${message.key} #${message.stream_seq}: ${JSON.stringify(message.data)}`);
  return "ack";
}

createServer((request, response) => {
  const chunks = [];
  request.on("data", (chunk) => chunks.push(chunk));
  request.on("end", () => {
    const body = Buffer.concat(chunks);
    if (!signed(request.headers, body)) {
      response.writeHead(401).end();
      return;
    }
    const failedKeys = new Set();
    const results = JSON.parse(body).map((message) => {
      if (failedKeys.has(message.key)) return { id: message.id, status: "retry" };
      const status = handle(message);
      if (status !== "ack") failedKeys.add(message.key);
      return { id: message.id, status, delay_ms: 1000 };
    });
    response.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ results }));
  });
}).listen(Number(process.argv[2]), "127.0.0.1");
