// keygate's JavaScript client: publish over fetch, and join a group as a
// member over a WebSocket with reconnects and resume. An ES module with no
// dependencies; the types (keygate.d.ts) are generated from the JSDoc here
// (scripts/check-clients checks that they match). The protocol it speaks is
// in docs/architecture.md ("WebSocket protocol"); docs/js-client.md shows it
// in use.

/**
 * @typedef {string | (() => string | null | undefined | Promise<string | null | undefined>)} TokenSource
 * A bearer token, or a function that gives one: called for every request
 * and before every (re)connect, so a refreshed token is used.
 */

/**
 * @typedef {object} ClientOptions
 * @property {string} [baseUrl] keygate's address (default: the page's origin).
 * @property {TokenSource} [token] Bearer token for the API and WebSockets.
 * @property {typeof fetch} [fetch] A `fetch` to use (default: the global one).
 * @property {typeof WebSocket} [WebSocket] A `WebSocket` to use (default: the global one).
 */

/**
 * @typedef {object} OutgoingMessage
 * @property {string} [key] Messages with one key are delivered in order.
 * @property {unknown} [data] The payload as JSON.
 * @property {string} [dataBase64] Or the payload as base64 bytes.
 * @property {string} [contentType]
 * @property {Record<string, string | string[]>} [headers]
 * @property {string} [msgId] De-duplication id.
 * @property {string} [subject] A subject (or pattern) other than the stream's own.
 */

/**
 * A message to publish before an ack (docs/pipelines.md): an outgoing
 * message without `msgId` (keygate derives it from the message acked),
 * and the stream, one of the `outputs` the connection declared.
 * @typedef {Omit<OutgoingMessage, "msgId"> & { stream: string }} OutputMessage
 */

/**
 * @typedef {object} PublishAck
 * @property {string} stream
 * @property {number} seq
 * @property {boolean} duplicate
 * @property {number} [partition]
 * @property {string} [key]
 * @property {string} [subject]
 */

/**
 * @typedef {object} BatchResult
 * @property {Array<PublishAck | { error: Problem }>} results One per message, in order.
 */

/**
 * @typedef {object} Problem An RFC 9457 problem answer.
 * @property {string} type
 * @property {string} title
 * @property {number} status
 * @property {string} [detail]
 */

/**
 * @typedef {object} PinInfo
 * @property {number[]} partitions
 * @property {number | null} [fencingToken]
 * @property {string} [instance]
 */

/**
 * @typedef {object} JoinOptions
 * @property {number} [maxInFlight] Key ordering: messages out at once (1–1000).
 * @property {number} [batch] Messages per frame (1–1000): keygate sends them
 *   together, and the verdicts of a frame's messages go back in one frame
 *   once each has one. Iterating is unchanged.
 * @property {number} [batchWaitMs] With `batch`: how long a frame that is
 *   not full waits for more messages (0–10000, default 0).
 * @property {number} [maxAttempts] Deliveries before a message is dead-lettered.
 * @property {string[]} [outputs] Streams this connection's acks may publish
 *   to (`message.ack({ publish })`; needs `publish:<stream>` for each).
 * @property {(pin: PinInfo) => void} [onPinned] This connection holds the member's pin.
 * @property {(pin: PinInfo) => void} [onStandby] Another instance holds it; this one waits.
 * @property {(partitions: number[]) => void} [onAssigned]
 * @property {(partitions: number[]) => void} [onRevoked]
 * @property {(event: Record<string, unknown>) => void} [onEvent] The member's events (`/v1/events` shape).
 * @property {(error: { error: string, id?: string }) => void} [onError] A frame keygate could not act on.
 * @property {(state: ConnectionState, detail?: { code?: number, reason?: string, delayMs?: number }) => void} [onState]
 * @property {number} [reconnectInitialMs] First reconnect delay (default 250), doubling with jitter...
 * @property {number} [reconnectMaxMs] ...up to this (default 10000).
 * @property {AbortSignal} [signal] Aborting it leaves, like `close()`.
 */

/**
 * @typedef {object} SubscribeOptions
 * @property {number} [concurrency] Messages in flight at once (1–256, default 4): no key order.
 * @property {number} [priority] `prioritized` consumers: 0 (served first) to 9.
 * @property {number} [minPending] `overflow` consumers: served only while this many wait.
 * @property {number} [minAckPending] `overflow` consumers: served only while this many are un-acked.
 */

/** @typedef {"connecting" | "open" | "reconnecting" | "closed"} ConnectionState */

/** An error answer of the API, with its problem. */
export class KeygateError extends Error {
  /**
   * @param {number} status
   * @param {Problem | null} problem
   * @param {string | null} retryAfter
   */
  constructor(status, problem, retryAfter) {
    super(problem?.detail || problem?.title || `keygate answered ${status}`);
    this.name = "KeygateError";
    /** The HTTP status. */
    this.status = status;
    /** The problem answer, when there was one. */
    this.problem = problem;
    /** `Retry-After` (seconds or a date), when keygate sent one. */
    this.retryAfter = retryAfter;
  }
}

/** A message delivered to a member, with its verdicts. */
export class Message {
  /**
   * @param {Record<string, any>} frame
   * @param {Connection} connection
   * @param {BatchVerdicts | null} [batch] The verdicts of the frame it came in.
   */
  constructor(frame, connection, batch = null) {
    /** Stable across redeliveries: `<stream>-<seq>`. */
    this.id = /** @type {string} */ (frame.id);
    this.stream = /** @type {string} */ (frame.stream);
    this.group = /** @type {string} */ (frame.group);
    this.member = /** @type {string} */ (frame.member);
    this.subject = /** @type {string} */ (frame.subject);
    this.key = /** @type {string | null} */ (frame.key ?? null);
    this.partition = /** @type {number} */ (frame.partition);
    this.streamSeq = /** @type {number} */ (frame.stream_seq);
    /** 1 on first delivery; more means it was delivered before. */
    this.attempt = /** @type {number} */ (frame.attempt);
    this.fencingToken = /** @type {number} */ (frame.fencing_token);
    this.headers = /** @type {Record<string, string>} */ (frame.headers ?? {});
    /** The payload when it is JSON. */
    this.data = /** @type {unknown} */ (frame.data);
    /** The payload in base64 when it is not JSON. */
    this.dataBase64 = /** @type {string | undefined} */ (frame.data_base64);
    /** @private */
    this.connection = connection;
    /** @private */
    this.batch = batch;
  }

  /**
   * Done: the key's next message may come. With `publish`, keygate first
   * stores those messages (each with an id derived from this message, so a
   * redelivery's are dropped as duplicates), then acks.
   * @param {{ publish?: OutputMessage[] }} [options]
   */
  ack(options = {}) {
    const outputs = options.publish === undefined ? {} : { publish: options.publish.map(output) };
    if (this.batch) this.batch.settle({ id: this.id, status: "ack", ...outputs });
    else this.connection.send({ type: "ack", id: this.id, ...outputs });
  }

  /**
   * Not now: redeliver after `delayMs` (at most 15 minutes); the key waits.
   * @param {number} [delayMs]
   */
  nak(delayMs) {
    const delay = delayMs === undefined ? {} : { delay_ms: delayMs };
    if (this.batch) this.batch.settle({ id: this.id, status: "retry", ...delay });
    else this.connection.send({ type: "nak", id: this.id, ...delay });
  }

  /** Never: dead-letter it; the key proceeds. */
  term() {
    if (this.batch) this.batch.settle({ id: this.id, status: "dead" });
    else this.connection.send({ type: "term", id: this.id });
  }

  /** Still working on it: keep it from being redelivered. */
  progress() {
    this.connection.send({ type: "progress", id: this.id });
  }
}

/**
 * A verdict for a message whose connection is gone. Nothing is lost:
 * keygate delivers the message again, with a higher `attempt`, on the
 * membership's next connection.
 */
export class ConnectionLost extends Error {
  /** @param {string} id */
  constructor(id) {
    super(`the connection that delivered ${id} is gone; keygate delivers it again`);
    this.name = "ConnectionLost";
    /** The message the verdict was for. */
    this.id = id;
  }
}

/**
 * One WebSocket of a membership. Verdicts for messages of an older
 * connection are refused: keygate redelivers those (with a higher
 * `attempt`) on the new one.
 */
class Connection {
  /** @param {WebSocket} socket */
  constructor(socket) {
    /** @type {WebSocket} */
    this.socket = socket;
  }

  /**
   * @param {{ type: string, id?: string, delay_ms?: number, results?: ItemVerdict[], publish?: Record<string, unknown>[] }} frame
   * @param {string} [id] The message the frame answers, for `ConnectionLost`.
   */
  send(frame, id = frame.id) {
    if (this.socket.readyState !== 1) throw new ConnectionLost(id ?? "");
    this.socket.send(JSON.stringify(frame));
  }
}

/** @typedef {{ id: string, status: "ack" | "retry" | "dead", delay_ms?: number, publish?: Record<string, unknown>[] }} ItemVerdict */

/**
 * The verdicts of one `batch` frame's messages, sent back in one
 * `results` frame once every message has one (keygate settles the batch
 * then anyway; a key's messages after a `retry` or `dead` one come again).
 */
class BatchVerdicts {
  /**
   * @param {Connection} connection
   * @param {number} size
   */
  constructor(connection, size) {
    /** @private */ this.connection = connection;
    /** @private */ this.size = size;
    /** @private @type {Map<string, ItemVerdict>} */ this.results = new Map();
  }

  /** @param {ItemVerdict} result */
  settle(result) {
    this.results.set(result.id, result);
    if (this.results.size === this.size) {
      this.connection.send({ type: "results", results: [...this.results.values()] }, result.id);
    }
  }
}

/**
 * A member's messages as an async iterator, over a WebSocket that
 * reconnects with backoff and resumes where the member's acks left off.
 * @implements {AsyncIterable<Message>}
 */
export class Membership {
  /**
   * @param {string} url The member's `…/ws` URL.
   * @param {() => Promise<string | null>} token
   * @param {typeof WebSocket} Socket
   * @param {JoinOptions} options
   */
  constructor(url, token, Socket, options) {
    /** @private */ this.url = url;
    /** @private */ this.token = token;
    /** @private */ this.Socket = Socket;
    /** @private */ this.options = options;
    /** @private @type {Message[]} */ this.queue = [];
    /** @private @type {Array<(result: IteratorResult<Message>) => void>} */ this.waiting = [];
    /** @private */ this.closed = false;
    /** @private @type {WebSocket | null} */ this.socket = null;
    /** @private */ this.failures = 0;
    /** @private @type {ReturnType<typeof setTimeout> | null} */ this.timer = null;
    /** The connection's state. @type {ConnectionState} */
    this.state = "connecting";
    options.signal?.addEventListener("abort", () => this.close());
    void this.connect();
  }

  /** @private */
  async connect() {
    if (this.closed) return;
    this.setState(this.failures === 0 ? "connecting" : "reconnecting");
    let socket;
    try {
      const token = await this.token();
      const protocols = token ? ["keygate.v1", `bearer.${token}`] : ["keygate.v1"];
      socket = new this.Socket(this.url, protocols);
    } catch (e) {
      this.retry({ reason: e instanceof Error ? e.message : String(e) });
      return;
    }
    if (this.closed) {
      socket.close(1000, "left");
      return;
    }
    this.socket = socket;
    const connection = new Connection(socket);
    socket.onopen = () => {
      this.failures = 0;
      this.setState("open");
    };
    socket.onmessage = (event) => this.onFrame(JSON.parse(String(event.data)), connection);
    socket.onclose = (event) => {
      if (this.socket === socket) this.socket = null;
      if (this.closed) {
        this.setState("closed", { code: event.code, reason: event.reason });
        return;
      }
      // A policy refusal (1008) will not change by retrying.
      if (event.code === 1008) {
        this.finish();
        this.setState("closed", { code: event.code, reason: event.reason });
        return;
      }
      this.retry({ code: event.code, reason: event.reason });
    };
  }

  /**
   * @private
   * @param {{ code?: number, reason?: string }} why
   */
  retry(why) {
    if (this.closed) return;
    const initial = this.options.reconnectInitialMs ?? 250;
    const max = this.options.reconnectMaxMs ?? 10000;
    const ceiling = Math.min(max, initial * 2 ** Math.min(this.failures, 16));
    const delayMs = Math.round(ceiling / 2 + Math.random() * (ceiling / 2));
    this.failures += 1;
    this.setState("reconnecting", { ...why, delayMs });
    this.timer = setTimeout(() => void this.connect(), delayMs);
  }

  /**
   * @private
   * @param {Record<string, any>} frame
   * @param {Connection} connection
   */
  onFrame(frame, connection) {
    const o = this.options;
    switch (frame.type) {
      case "message":
        this.push(new Message(frame, connection));
        break;
      case "batch": {
        const verdicts = new BatchVerdicts(connection, frame.messages.length);
        for (const message of frame.messages) this.push(new Message(message, connection, verdicts));
        break;
      }
      case "pinned":
        o.onPinned?.({ partitions: frame.partitions, fencingToken: frame.fencing_token, instance: frame.instance });
        break;
      case "standby":
        o.onStandby?.({ partitions: frame.partitions });
        break;
      case "assigned":
        o.onAssigned?.(frame.partitions);
        break;
      case "revoked":
        o.onRevoked?.(frame.partitions);
        break;
      case "event":
        o.onEvent?.(frame.event);
        break;
      case "error":
        o.onError?.({ error: frame.error, id: frame.id });
        break;
    }
  }

  /**
   * @private
   * @param {Message} message
   */
  push(message) {
    const next = this.waiting.shift();
    if (next) next({ value: message, done: false });
    else this.queue.push(message);
  }

  /**
   * @private
   * @param {ConnectionState} state
   * @param {{ code?: number, reason?: string, delayMs?: number }} [detail]
   */
  setState(state, detail) {
    this.state = state;
    this.options.onState?.(state, detail);
  }

  /** @private */
  finish() {
    this.closed = true;
    for (const resolve of this.waiting.splice(0)) resolve({ value: undefined, done: true });
  }

  /** Leaves: closes the WebSocket; what was not acked is delivered again later. */
  close() {
    if (this.closed) return;
    this.finish();
    if (this.timer) clearTimeout(this.timer);
    if (this.socket) this.socket.close(1000, "left");
    else this.setState("closed");
  }

  /** @returns {AsyncIterator<Message>} */
  [Symbol.asyncIterator]() {
    return {
      next: () => {
        const queued = this.queue.shift();
        if (queued) return Promise.resolve({ value: queued, done: false });
        if (this.closed) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve) => this.waiting.push(resolve));
      },
      return: () => {
        this.close();
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}

/** keygate's API: publishing, and joining groups as a member. */
export class KeygateClient {
  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    const origin = typeof location === "undefined" ? undefined : location.origin;
    const base = options.baseUrl ?? origin;
    if (!base) throw new TypeError("baseUrl is required outside a browser page");
    /** @private */ this.base = base.replace(/\/+$/, "");
    /** @private */ this.tokenSource = options.token;
    /** @private */ this.fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
    /** @private */ this.Socket = options.WebSocket ?? globalThis.WebSocket;
  }

  /**
   * @private
   * @returns {Promise<string | null>}
   */
  async token() {
    const source = this.tokenSource;
    const token = typeof source === "function" ? await source() : source;
    return token || null;
  }

  /**
   * @private
   * @param {string} method
   * @param {string} path
   * @param {unknown} body
   */
  async request(method, path, body) {
    /** @type {Record<string, string>} */
    const headers = { "content-type": "application/json" };
    const token = await this.token();
    if (token) headers.authorization = `Bearer ${token}`;
    const response = await this.fetchImpl(this.base + path, { method, headers, body: JSON.stringify(body) });
    const text = await response.text();
    const parsed = text ? JSON.parse(text) : null;
    if (!response.ok) throw new KeygateError(response.status, parsed, response.headers.get("retry-after"));
    return parsed;
  }

  /**
   * Publishes one message; resolves once JetStream has stored it.
   * @param {string} stream
   * @param {OutgoingMessage} message
   * @returns {Promise<PublishAck>}
   */
  publish(stream, message) {
    return this.request("POST", `/v1/streams/${encodeURIComponent(stream)}/messages`, wire(message));
  }

  /**
   * Publishes several messages at once, each key's in order; with
   * `atomic`, all or none are stored.
   * @param {string} stream
   * @param {OutgoingMessage[]} messages
   * @param {{ atomic?: boolean }} [options]
   * @returns {Promise<BatchResult>}
   */
  publishBatch(stream, messages, options = {}) {
    const body = { messages: messages.map(wire), ...(options.atomic ? { atomic: true } : {}) };
    return this.request("POST", `/v1/streams/${encodeURIComponent(stream)}/messages/batch`, body);
  }

  /**
   * Joins `group` of `stream` as `member`: its messages, in key order.
   * @param {string} stream
   * @param {string} group
   * @param {string} member
   * @param {JoinOptions} [options]
   * @returns {Membership}
   */
  join(stream, group, member, options = {}) {
    const query = {
      max_in_flight: options.maxInFlight,
      max_attempts: options.maxAttempts,
      batch: options.batch,
      batch_wait_ms: options.batchWaitMs,
      outputs: options.outputs?.join(","),
    };
    return this.socket([stream, "groups", group, "members", member], query, options);
  }

  /**
   * Subscribes to a plain consumer of `stream` as `subscriber`: its
   * messages with no key order, up to `concurrency` at once, with the same
   * reconnects, resume and callbacks as `join` (`onPinned` / `onStandby`
   * for `pinned_client` consumers).
   * @param {string} stream
   * @param {string} consumer
   * @param {string} subscriber
   * @param {JoinOptions & SubscribeOptions} [options]
   * @returns {Membership}
   */
  subscribe(stream, consumer, subscriber, options = {}) {
    const query = {
      concurrency: options.concurrency,
      priority: options.priority,
      min_pending: options.minPending,
      min_ack_pending: options.minAckPending,
      max_attempts: options.maxAttempts,
      batch: options.batch,
      batch_wait_ms: options.batchWaitMs,
      outputs: options.outputs?.join(","),
    };
    return this.socket([stream, "consumers", consumer, "subscribers", subscriber], query, options);
  }

  /**
   * @private
   * @param {string[]} segments Under `/v1/streams/`, before `/ws`.
   * @param {Record<string, number | string | undefined>} query
   * @param {JoinOptions} options
   * @returns {Membership}
   */
  socket(segments, query, options) {
    if (!this.Socket) throw new TypeError("no WebSocket: pass one in the client's options");
    const search = new URLSearchParams();
    for (const [name, value] of Object.entries(query)) {
      if (value !== undefined) search.set(name, String(value));
    }
    const path = segments.map(encodeURIComponent).join("/");
    const tail = search.toString() ? `?${search}` : "";
    const url = `${this.base.replace(/^http/, "ws")}/v1/streams/${path}/ws${tail}`;
    return new Membership(url, () => this.token(), this.Socket, options);
  }
}

/**
 * The API's shape of an output: a message's, with its stream.
 * @param {OutputMessage} m
 */
function output(m) {
  return { stream: m.stream, ...wire(m) };
}

/**
 * The API's shape of a message.
 * @param {OutgoingMessage} m
 */
function wire(m) {
  /** @type {Record<string, unknown>} */
  const body = {};
  if (m.key !== undefined) body.key = m.key;
  if (m.data !== undefined) body.data = m.data;
  if (m.dataBase64 !== undefined) body.data_base64 = m.dataBase64;
  if (m.contentType !== undefined) body.content_type = m.contentType;
  if (m.headers !== undefined) body.headers = m.headers;
  if (m.msgId !== undefined) body.msg_id = m.msgId;
  if (m.subject !== undefined) body.subject = m.subject;
  return body;
}
