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
    constructor(status: number, problem: Problem | null, retryAfter: string | null);
    /** The HTTP status. */
    status: number;
    /** The problem answer, when there was one. */
    problem: Problem | null;
    /** `Retry-After` (seconds or a date), when keygate sent one. */
    retryAfter: string | null;
}
/** A message delivered to a member, with its verdicts. */
export class Message {
    /**
     * @param {Record<string, any>} frame
     * @param {Connection} connection
     * @param {BatchVerdicts | null} [batch] The verdicts of the frame it came in.
     */
    constructor(frame: Record<string, any>, connection: Connection, batch?: BatchVerdicts | null);
    /** Stable across redeliveries: `<stream>-<seq>`. */
    id: string;
    stream: string;
    group: string;
    member: string;
    subject: string;
    key: string | null;
    partition: number;
    streamSeq: number;
    /** 1 on first delivery; more means it was delivered before. */
    attempt: number;
    fencingToken: number;
    headers: Record<string, string>;
    /** The payload when it is JSON. */
    data: unknown;
    /** The payload in base64 when it is not JSON. */
    dataBase64: string | undefined;
    /** @private */
    private connection;
    /** @private */
    private batch;
    /**
     * Done: the key's next message may come. With `publish`, keygate first
     * stores those messages (each with an id derived from this message, so a
     * redelivery's are dropped as duplicates), then acks.
     * @param {{ publish?: OutputMessage[] }} [options]
     */
    ack(options?: {
        publish?: OutputMessage[];
    }): void;
    /**
     * Not now: redeliver after `delayMs` (at most 15 minutes); the key waits.
     * @param {number} [delayMs]
     */
    nak(delayMs?: number): void;
    /** Never: dead-letter it; the key proceeds. */
    term(): void;
    /** Still working on it: keep it from being redelivered. */
    progress(): void;
}
/**
 * A verdict for a message whose connection is gone. Nothing is lost:
 * keygate delivers the message again, with a higher `attempt`, on the
 * membership's next connection.
 */
export class ConnectionLost extends Error {
    /** @param {string} id */
    constructor(id: string);
    /** The message the verdict was for. */
    id: string;
}
/**
 * A member's messages as an async iterator, over a WebSocket that
 * reconnects with backoff and resumes where the member's acks left off.
 * @implements {AsyncIterable<Message>}
 */
export class Membership implements AsyncIterable<Message> {
    /**
     * @param {string} url The member's `…/ws` URL.
     * @param {() => Promise<string | null>} token
     * @param {typeof WebSocket} Socket
     * @param {JoinOptions} options
     */
    constructor(url: string, token: () => Promise<string | null>, Socket: typeof WebSocket, options: JoinOptions);
    /** @private */ private url;
    /** @private */ private token;
    /** @private */ private Socket;
    /** @private */ private options;
    /** @private @type {Message[]} */ private queue;
    /** @private @type {Array<(result: IteratorResult<Message>) => void>} */ private waiting;
    /** @private */ private closed;
    /** @private @type {WebSocket | null} */ private socket;
    /** @private */ private failures;
    /** @private @type {ReturnType<typeof setTimeout> | null} */ private timer;
    /** The connection's state. @type {ConnectionState} */
    state: ConnectionState;
    /** @private */
    private connect;
    /**
     * @private
     * @param {{ code?: number, reason?: string }} why
     */
    private retry;
    /**
     * @private
     * @param {Record<string, any>} frame
     * @param {Connection} connection
     */
    private onFrame;
    /**
     * @private
     * @param {Message} message
     */
    private push;
    /**
     * @private
     * @param {ConnectionState} state
     * @param {{ code?: number, reason?: string, delayMs?: number }} [detail]
     */
    private setState;
    /** @private */
    private finish;
    /** Leaves: closes the WebSocket; what was not acked is delivered again later. */
    close(): void;
    /** @returns {AsyncIterator<Message>} */
    [Symbol.asyncIterator](): AsyncIterator<Message>;
}
/** keygate's API: publishing, and joining groups as a member. */
export class KeygateClient {
    /** @param {ClientOptions} [options] */
    constructor(options?: ClientOptions);
    /** @private */ private base;
    /** @private */ private tokenSource;
    /** @private */ private fetchImpl;
    /** @private */ private Socket;
    /**
     * @private
     * @returns {Promise<string | null>}
     */
    private token;
    /**
     * @private
     * @param {string} method
     * @param {string} path
     * @param {unknown} body
     */
    private request;
    /**
     * Publishes one message; resolves once JetStream has stored it.
     * @param {string} stream
     * @param {OutgoingMessage} message
     * @returns {Promise<PublishAck>}
     */
    publish(stream: string, message: OutgoingMessage): Promise<PublishAck>;
    /**
     * Publishes several messages at once, each key's in order; with
     * `atomic`, all or none are stored.
     * @param {string} stream
     * @param {OutgoingMessage[]} messages
     * @param {{ atomic?: boolean }} [options]
     * @returns {Promise<BatchResult>}
     */
    publishBatch(stream: string, messages: OutgoingMessage[], options?: {
        atomic?: boolean;
    }): Promise<BatchResult>;
    /**
     * Joins `group` of `stream` as `member`: its messages, in key order.
     * @param {string} stream
     * @param {string} group
     * @param {string} member
     * @param {JoinOptions} [options]
     * @returns {Membership}
     */
    join(stream: string, group: string, member: string, options?: JoinOptions): Membership;
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
    subscribe(stream: string, consumer: string, subscriber: string, options?: JoinOptions & SubscribeOptions): Membership;
    /**
     * @private
     * @param {string[]} segments Under `/v1/streams/`, before `/ws`.
     * @param {Record<string, number | string | undefined>} query
     * @param {JoinOptions} options
     * @returns {Membership}
     */
    private socket;
}
/**
 * A bearer token, or a function that gives one: called for every request
 * and before every (re)connect, so a refreshed token is used.
 */
export type TokenSource = string | (() => string | null | undefined | Promise<string | null | undefined>);
export type ClientOptions = {
    /**
     * keygate's address (default: the page's origin).
     */
    baseUrl?: string | undefined;
    /**
     * Bearer token for the API and WebSockets.
     */
    token?: TokenSource | undefined;
    /**
     * A `fetch` to use (default: the global one).
     */
    fetch?: typeof fetch | undefined;
    /**
     * A `WebSocket` to use (default: the global one).
     */
    WebSocket?: {
        new (url: string | URL, protocols?: string | string[]): WebSocket;
        prototype: WebSocket;
        readonly CONNECTING: 0;
        readonly OPEN: 1;
        readonly CLOSING: 2;
        readonly CLOSED: 3;
    } | undefined;
};
export type OutgoingMessage = {
    /**
     * Messages with one key are delivered in order.
     */
    key?: string | undefined;
    /**
     * The payload as JSON.
     */
    data?: unknown;
    /**
     * Or the payload as base64 bytes.
     */
    dataBase64?: string | undefined;
    contentType?: string | undefined;
    headers?: Record<string, string | string[]> | undefined;
    /**
     * De-duplication id.
     */
    msgId?: string | undefined;
    /**
     * A subject (or pattern) other than the stream's own.
     */
    subject?: string | undefined;
};
/**
 * A message to publish before an ack (docs/pipelines.md): an outgoing
 * message without `msgId` (keygate derives it from the message acked),
 * and the stream, one of the `outputs` the connection declared.
 */
export type OutputMessage = Omit<OutgoingMessage, "msgId"> & {
    stream: string;
};
export type PublishAck = {
    stream: string;
    seq: number;
    duplicate: boolean;
    partition?: number | undefined;
    key?: string | undefined;
    subject?: string | undefined;
};
export type BatchResult = {
    /**
     * One per message, in order.
     */
    results: Array<PublishAck | {
        error: Problem;
    }>;
};
/**
 * An RFC 9457 problem answer.
 */
export type Problem = {
    type: string;
    title: string;
    status: number;
    detail?: string | undefined;
};
export type PinInfo = {
    partitions: number[];
    fencingToken?: number | null | undefined;
    instance?: string | undefined;
};
export type JoinOptions = {
    /**
     * Key ordering: messages out at once (1–1000).
     */
    maxInFlight?: number | undefined;
    /**
     * Messages per frame (1–1000): keygate sends them
     * together, and the verdicts of a frame's messages go back in one frame
     * once each has one. Iterating is unchanged.
     */
    batch?: number | undefined;
    /**
     * With `batch`: how long a frame that is
     * not full waits for more messages (0–10000, default 0).
     */
    batchWaitMs?: number | undefined;
    /**
     * Deliveries before a message is dead-lettered.
     */
    maxAttempts?: number | undefined;
    /**
     * Streams this connection's acks may publish
     * to (`message.ack({ publish })`; needs `publish:<stream>` for each).
     */
    outputs?: string[] | undefined;
    /**
     * This connection holds the member's pin.
     */
    onPinned?: ((pin: PinInfo) => void) | undefined;
    /**
     * Another instance holds it; this one waits.
     */
    onStandby?: ((pin: PinInfo) => void) | undefined;
    onAssigned?: ((partitions: number[]) => void) | undefined;
    onRevoked?: ((partitions: number[]) => void) | undefined;
    /**
     * The member's events (`/v1/events` shape).
     */
    onEvent?: ((event: Record<string, unknown>) => void) | undefined;
    /**
     * A frame keygate could not act on.
     */
    onError?: ((error: {
        error: string;
        id?: string;
    }) => void) | undefined;
    onState?: ((state: ConnectionState, detail?: {
        code?: number;
        reason?: string;
        delayMs?: number;
    }) => void) | undefined;
    /**
     * First reconnect delay (default 250), doubling with jitter...
     */
    reconnectInitialMs?: number | undefined;
    /**
     * ...up to this (default 10000).
     */
    reconnectMaxMs?: number | undefined;
    /**
     * Aborting it leaves, like `close()`.
     */
    signal?: AbortSignal | undefined;
};
export type SubscribeOptions = {
    /**
     * Messages in flight at once (1–256, default 4): no key order.
     */
    concurrency?: number | undefined;
    /**
     * `prioritized` consumers: 0 (served first) to 9.
     */
    priority?: number | undefined;
    /**
     * `overflow` consumers: served only while this many wait.
     */
    minPending?: number | undefined;
    /**
     * `overflow` consumers: served only while this many are un-acked.
     */
    minAckPending?: number | undefined;
};
export type ConnectionState = "connecting" | "open" | "reconnecting" | "closed";
export type ItemVerdict = {
    id: string;
    status: "ack" | "retry" | "dead";
    delay_ms?: number;
    publish?: Record<string, unknown>[];
};
/**
 * One WebSocket of a membership. Verdicts for messages of an older
 * connection are refused: keygate redelivers those (with a higher
 * `attempt`) on the new one.
 */
declare class Connection {
    /** @param {WebSocket} socket */
    constructor(socket: WebSocket);
    /** @type {WebSocket} */
    socket: WebSocket;
    /**
     * @param {{ type: string, id?: string, delay_ms?: number, results?: ItemVerdict[], publish?: Record<string, unknown>[] }} frame
     * @param {string} [id] The message the frame answers, for `ConnectionLost`.
     */
    send(frame: {
        type: string;
        id?: string;
        delay_ms?: number;
        results?: ItemVerdict[];
        publish?: Record<string, unknown>[];
    }, id?: string): void;
}
/** @typedef {{ id: string, status: "ack" | "retry" | "dead", delay_ms?: number, publish?: Record<string, unknown>[] }} ItemVerdict */
/**
 * The verdicts of one `batch` frame's messages, sent back in one
 * `results` frame once every message has one (keygate settles the batch
 * then anyway; a key's messages after a `retry` or `dead` one come again).
 */
declare class BatchVerdicts {
    /**
     * @param {Connection} connection
     * @param {number} size
     */
    constructor(connection: Connection, size: number);
    /** @private */ private connection;
    /** @private */ private size;
    /** @private @type {Map<string, ItemVerdict>} */ private results;
    /** @param {ItemVerdict} result */
    settle(result: ItemVerdict): void;
}
export {};
