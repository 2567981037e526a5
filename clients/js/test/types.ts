// The declared API as a TypeScript user calls it, type-checked with
// `tsc --strict` by scripts/check-clients (never run: the browser tests in
// tests/it/js_client.rs run the module itself).
import { ConnectionLost, KeygateClient, KeygateError, type Message, type PublishAck } from "../keygate.js";

export async function example(): Promise<void> {
  let refreshed = 0;
  const client = new KeygateClient({ baseUrl: "http://127.0.0.1:8080", token: async () => `token-${++refreshed}` });
  const ack: PublishAck = await client.publish("ORDERS", { key: "alice", data: { total: 5 } });
  const seq: number = ack.seq;
  const batch = await client.publishBatch("ORDERS", [{ key: "bob", dataBase64: "AAE=" }], { atomic: true });
  for (const result of batch.results) {
    if ("error" in result) console.log(result.error.status, result.error.detail);
    else console.log(result.seq + seq);
  }
  const membership = client.join("ORDERS", "fulfillment", "m1", {
    maxInFlight: 16,
    onPinned: ({ partitions, fencingToken }) => console.log(partitions.length, fencingToken),
    onStandby: ({ partitions }) => console.log(partitions),
    onEvent: (event) => console.log(event["type"]),
    onState: (state, detail) => console.log(state, detail?.delayMs),
  });
  for await (const message of membership) {
    const m: Message = message;
    try {
      if (m.attempt > 3) m.term();
      else if (m.key === null) m.nak(1000);
      else m.ack();
    } catch (e) {
      if (e instanceof ConnectionLost) console.log("redelivered later:", e.id);
    }
  }
  try {
    await client.publish("NOPE", { data: 1 });
  } catch (e) {
    if (e instanceof KeygateError) console.log(e.status, e.problem?.title, e.retryAfter);
  }
  membership.close();
  const batched = client.join("ORDERS", "fulfillment", "m2", { batch: 100, batchWaitMs: 5 });
  for await (const message of batched) message.ack();
  const work = client.subscribe("JOBS", "workers", "w1", { concurrency: 8, onStandby: () => console.log("standby") });
  for await (const job of work) job.ack();
  const stage = client.join("ORDERS", "enrich", "m1", { outputs: ["PAYMENTS"] });
  for await (const order of stage) {
    order.ack({ publish: [{ stream: "PAYMENTS", key: order.key ?? undefined, data: { order: order.streamSeq } }] });
  }
}
