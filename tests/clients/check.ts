// A TypeScript client generated from openapi/openapi.json by
// openapi-typescript, used as a user would: type-checked with
// `tsc --strict`, then run with node against a live keygate
// (scripts/check-clients).
import createClient from "openapi-fetch";
import type { components, paths } from "./schema";

type Problem = components["schemas"]["Problem"];

const base = process.argv[2];
const client = createClient<paths>({ baseUrl: base });

function fail(message: string): never {
  throw new Error(message);
}

async function main(): Promise<void> {
  const stream = await client.PUT("/v1/streams/{stream}", {
    params: { path: { stream: "TSC" } },
    body: { subjects: ["tsc.*"], partitions: 4 },
  });
  if (stream.response.status !== 201) fail(`stream: ${stream.response.status}`);

  // Any JSON value is a payload: a number, a string, an object, an array.
  let ackPartition = -1;
  for (const data of [1, "text", { id: 7, tags: ["a"] }, [1, 2], null]) {
    const published = await client.POST("/v1/streams/{stream}/messages", {
      params: { path: { stream: "TSC" } },
      body: { key: "alice", data, headers: { "x-one": "1", "x-many": ["a", "b"] } },
    });
    if (!published.data) fail(`publish ${JSON.stringify(data)}: ${published.response.status}`);
    const ack: components["schemas"]["PublishAck"] = published.data;
    if (ack.stream !== "TSC" || ack.key !== "alice" || typeof ack.seq !== "number") fail(JSON.stringify(ack));
    ackPartition = ack.partition ?? -1;
  }

  const group = await client.PUT("/v1/streams/{stream}/groups/{group}", {
    params: { path: { stream: "TSC", group: "g" } },
    body: { kind: "static", partitions: 4, members: ["m1", "m2"] },
  });
  if (group.response.status !== 201) fail(`group: ${group.response.status}`);
  const view = await client.GET("/v1/streams/{stream}/groups/{group}", {
    params: { path: { stream: "TSC", group: "g" } },
  });
  if (!view.data || view.data.partitions !== 4 || view.data.members.length !== 2) fail(JSON.stringify(view.data));

  // Pull: alice's five messages, fetched as the member owning her
  // partition and acked in batches.
  const owner = view.data.assignment.find((a) => a.partitions.includes(ackPartition))?.member ?? fail("no owner");
  const seqs: number[] = [];
  for (let round = 0; round < 20 && seqs.length < 5; round++) {
    const fetched = await client.POST("/v1/streams/{stream}/groups/{group}/members/{member}/fetch", {
      params: { path: { stream: "TSC", group: "g", member: owner } },
      body: { max_messages: 10, wait_ms: 2000 },
    });
    const answer: components["schemas"]["FetchAnswer"] = fetched.data ?? fail(`fetch: ${fetched.response.status}`);
    if (answer.messages.length === 0) continue;
    seqs.push(...answer.messages.map((m) => m.stream_seq));
    const acked = await client.POST("/v1/streams/{stream}/groups/{group}/members/{member}/acks", {
      params: { path: { stream: "TSC", group: "g", member: owner } },
      body: { ack: answer.messages.map((m) => m.ack_id) },
    });
    if (!acked.data || acked.data.settled !== answer.messages.length || acked.data.failed.length) {
      fail(`acks: ${JSON.stringify(acked.data)}`);
    }
  }
  if (seqs.length !== 5 || seqs.some((s, i) => i > 0 && s < seqs[i - 1])) fail(`pulled ${JSON.stringify(seqs)}`);

  // A batched webhook for the other member: the batch options go in and come back.
  const other = view.data.members.find((m) => m !== owner) ?? fail("no other member");
  const hook = await client.PUT("/v1/streams/{stream}/groups/{group}/members/{member}/webhook", {
    params: { path: { stream: "TSC", group: "g", member: other } },
    body: { url: "http://127.0.0.1:9/hook", batch: { max_messages: 100, max_wait_ms: 20 } },
  });
  const registered: components["schemas"]["WebhookView"] = hook.data ?? fail(`webhook: ${hook.response.status}`);
  if (registered.batch?.max_messages !== 100 || registered.batch?.max_wait_ms !== 20) fail(JSON.stringify(registered));

  // A problem answer parses as the document says.
  const missing = await client.GET("/v1/streams/{stream}", { params: { path: { stream: "NOPE" } } });
  const problem: Problem | undefined = missing.error;
  if (missing.response.status !== 404 || !problem || problem.status !== 404 || !problem.detail) {
    fail(`problem: ${JSON.stringify(problem)}`);
  }
  console.log("typescript client: published 5 payload kinds, created and read a group, fetched and acked as a pull member, registered a batched webhook, parsed a 404 problem");
}

main().catch((e: unknown) => {
  console.error(e);
  process.exit(1);
});
