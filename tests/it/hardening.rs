//! Findings of the outside audit (hostile and careless clients), each pinned
//! down against a real nats-server.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::receiver::{Answer, Receiver};
use crate::support::ws::{member_url, WsClient};
use crate::support::{eventually, http_client, KeygateProcess, NatsServer, TestApp};

const WAIT: Duration = Duration::from_secs(10);

async fn stream_and_group(app: &TestApp, group: &str, members: Value) {
    app.create_stream("S", json!({"subjects":["s.*"],"partitions":2})).await;
    let body = json!({"kind":"static","partitions":2,"members":members,"ack_wait_ms":2000});
    let (status, view) = app.put(&format!("/v1/streams/S/groups/{group}"), body).await;
    assert_eq!(status, 201, "{view}");
}

/// The dead letters stored, as (their `Nats-Msg-Id`, `keygate-owner`).
async fn dead_letters(app: &TestApp) -> Vec<(String, String)> {
    if app.js.get_stream("KEYGATE_DEAD_LETTERS").await.is_err() {
        return Vec::new();
    }
    app.stream_messages("KEYGATE_DEAD_LETTERS")
        .await
        .into_iter()
        .map(|(_, _, headers)| {
            let headers = headers.unwrap_or_default();
            let get = |n: &str| headers.get(n).map(|v| v.to_string()).unwrap_or_default();
            (get("Nats-Msg-Id"), get("keygate-owner"))
        })
        .collect()
}

/// A retried termination finds its dead letter already stored and goes on;
/// a `duplicate` answer for another message under the same id (the stream
/// was deleted and created again, and its sequences came round again) is
/// an error, so that message is not terminated without its copy.
#[tokio::test]
async fn a_duplicate_dead_letter_is_accepted_only_for_the_same_message() {
    use keygate::dead_letters::{record, DeadLetter};
    use keygate::names::Owner;
    let app = TestApp::start().await;
    let letter = |payload: &'static str| DeadLetter {
        owner: Owner::Group,
        stream: "S",
        group: "g",
        member: "m1",
        subject: "s.alice",
        key: Some("alice"),
        partition: 0,
        stream_seq: 7,
        attempts: 3,
        reason: "HTTP 500",
        headers: None,
        payload: payload.into(),
    };
    let buckets = keygate::nats::buckets::Buckets::new(app.js.clone(), None);
    let first = record(&buckets, letter("{\"i\":1}")).await.unwrap();
    let retried = record(&buckets, letter("{\"i\":1}")).await.unwrap();
    assert_eq!(first, retried, "the retry finds the stored copy");
    let error = record(&buckets, letter("{\"i\":2}")).await.unwrap_err();
    assert!(error.to_string().contains("another message"), "{error}");
    assert_eq!(app.stream_messages("KEYGATE_DEAD_LETTERS").await.len(), 1);
}

#[tokio::test]
async fn a_group_and_a_plain_consumer_of_one_name_each_keep_their_dead_letter() {
    let app = TestApp::start().await;
    stream_and_group(&app, "billing", json!(["m1"])).await;
    let refusing = Receiver::start(|_, _| Answer::status(400)).await;
    let hook = json!({"url": refusing.url("/group")});
    assert_eq!(app.put("/v1/streams/S/groups/billing/members/m1/webhook", hook).await.0, 201);
    let consumer = json!({"policy":"none","ack_wait_ms":2000});
    let (status, view) = app.put("/v1/streams/S/consumers/billing", consumer).await;
    assert_eq!(status, 201, "{view}");
    let hook = json!({"url": refusing.url("/plain")});
    let (status, view) = app.put("/v1/streams/S/consumers/billing/subscribers/m1/webhook", hook).await;
    assert_eq!(status, 201, "{view}");
    let (status, _) = app.post("/v1/streams/S/messages", json!({"key":"k","data":1})).await;
    assert_eq!(status, 200);
    let letters = eventually(WAIT, || async {
        let letters = dead_letters(&app).await;
        (letters.len() >= 2).then_some(letters)
    })
    .await;
    let owners: std::collections::BTreeSet<&str> = letters.iter().map(|(_, o)| o.as_str()).collect();
    assert_eq!(owners, ["consumer", "group"].into(), "{letters:?}");
    assert_ne!(letters[0].0, letters[1].0, "distinct ids");
}

#[tokio::test]
async fn websocket_nak_delays_are_capped_at_fifteen_minutes() {
    let app = TestApp::start().await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    let mut client = WsClient::connect(&member_url(&app.base, "S", "g", "m1", "")).await;
    client.next_of("assigned", WAIT).await;
    app.post("/v1/streams/S/messages", json!({"key":"k","data":1})).await;
    let message = client.next_of("message", WAIT).await;
    client.send(json!({"type":"nak","id":message["id"],"delay_ms":1_000_000_000_000u64})).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let frame = client.next_of("event", WAIT).await;
        if frame["event"]["type"] == "message.naked" {
            assert_eq!(frame["event"]["delay_ms"], 900_000, "{frame}");
            break;
        }
        assert!(Instant::now() < deadline, "no message.naked event");
    }
}

#[tokio::test]
async fn plain_consumer_routes_refuse_a_group_members_consumer() {
    let app = TestApp::start().await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    // The member's consumer exists once an instance joined it.
    let mut member = WsClient::connect(&member_url(&app.base, "S", "g", "m1", "")).await;
    member.next_of("assigned", WAIT).await;
    eventually(WAIT, || async { (app.get("/v1/streams/S/consumers/g-m1").await.0 == 200).then_some(()) }).await;
    let hook = json!({"url":"http://127.0.0.1:9/x"});
    let (status, problem) = app.put("/v1/streams/S/consumers/g-m1/subscribers/x/webhook", hook).await;
    assert_eq!(status, 409, "{problem}");
    let url =
        format!("{}/v1/streams/S/consumers/g-m1/subscribers/x/ws?concurrency=256", app.base.replace("http", "ws"));
    match WsClient::connect_with(&url, &[]).await {
        Ok(_) => panic!("a plain subscriber attached to a member's consumer"),
        Err(status) => assert_eq!(status, 409),
    }
}

#[tokio::test]
async fn a_plain_consumer_cannot_take_a_members_name_before_the_member_joins() {
    let app = TestApp::start().await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    // No instance has joined: the member's consumer g-m1 does not exist yet.
    assert_eq!(app.get("/v1/streams/S/consumers/g-m1").await.0, 404);
    let (status, problem) = app.put("/v1/streams/S/consumers/g-m1", json!({"policy":"none"})).await;
    assert_eq!(status, 409, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("group g"), "{problem}");
    assert_eq!(app.get("/v1/streams/S/consumers/g-m1").await.0, 404, "nothing was created");
    assert_eq!(app.put("/v1/streams/S/consumers/g-m2", json!({"policy":"none"})).await.0, 201, "other names are free");
}

#[tokio::test]
async fn a_client_that_sends_half_a_request_is_disconnected() {
    let app = TestApp::start_with(|s| s.header_read_timeout = Duration::from_millis(500)).await;
    let address = app.base.trim_start_matches("http://").to_owned();
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1").await.unwrap();
    let started = Instant::now();
    let mut buffer = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), slow.read(&mut buffer)).await;
    assert!(matches!(read, Ok(Ok(_)) | Ok(Err(_))), "still open after 5 s");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Well-behaved clients are unaffected.
    assert_eq!(app.get("/healthz").await.0, 200);
}

#[tokio::test]
async fn websocket_subscribers_that_come_and_go_leave_nothing_behind() {
    // The server's monitoring port counts the subscriptions keygate holds.
    let monitor = crate::support::free_port();
    let server = NatsServer::start_with(&["-m", &monitor.to_string()]);
    let app = TestApp::start_on(server.url()).await;
    let subscriptions = || async move {
        let subsz: Value =
            http_client().get(format!("http://127.0.0.1:{monitor}/subsz")).send().await.unwrap().json().await.unwrap();
        subsz["num_subscriptions"].as_u64().unwrap()
    };
    app.create_stream("J", json!({"subjects":["j.*"]})).await;
    assert_eq!(app.put("/v1/streams/J/consumers/c", json!({"policy":"none"})).await.0, 201);
    let tasks = || async {
        let text = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("keygate_runtime_alive_tasks ").and_then(|v| v.parse::<f64>().ok()))
            .unwrap()
    };
    let cycle = |i: usize| {
        let url = format!("{}/v1/streams/J/consumers/c/subscribers/s{i}/ws", app.base.replace("http", "ws"));
        async move {
            let client = WsClient::connect(&url).await;
            client.close().await;
        }
    };
    for i in 0..10 {
        cycle(i).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (before, subscribed_before) = (tasks().await, subscriptions().await);
    for i in 10..110 {
        cycle(i).await;
    }
    let (after, subscribed_after) = eventually(WAIT, || async {
        let (now, subscribed) = (tasks().await, subscriptions().await);
        (now <= before + 10.0 && subscribed <= subscribed_before + 2).then_some((now, subscribed))
    })
    .await;
    println!(
        "alive tasks: {before} before 100 connect/close cycles, {after} after; server subscriptions \
         {subscribed_before} before, {subscribed_after} after"
    );
}

#[tokio::test]
async fn an_event_stream_client_that_stops_reading_is_dropped_with_a_last_event() {
    let app = TestApp::start().await;
    // A client with a small receive window that never reads.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let address: std::net::SocketAddr = app.base.trim_start_matches("http://").parse().unwrap();
    let mut client = socket.connect(address).await.unwrap();
    let request = format!("GET /v1/events?types=message.acked HTTP/1.1\r\nHost: {address}\r\n\r\n");
    client.write_all(request.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    client.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    // Events as keygate replicas publish them, far more than the socket
    // buffers and the client's queue hold (about 40 MB).
    const EVENTS: usize = 20_000;
    let padding = "x".repeat(2000);
    for i in 0..EVENTS {
        let event = json!({"type":"message.acked","stream":"S","group":"g","member":"m1","seq":i,"reason":padding});
        app.nats.publish("keygate.events.S.g.m1.message.acked", event.to_string().into()).await.unwrap();
    }
    app.nats.flush().await.unwrap();
    let mut body = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut body)).await;
    assert!(read.is_ok(), "the stream ended");
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("event: stream.lagged"), "the last event says why");
    let delivered = body.matches("event: message.acked").count();
    assert!(delivered < EVENTS, "{delivered} events were kept for a client that did not read");
}

#[tokio::test]
async fn open_mode_answers_only_loopback_names_and_refuses_cross_site_changes() {
    let app = TestApp::start().await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    let rebound = app.http.get(app.url("/v1/streams")).header("host", "evil.test").send().await.unwrap();
    assert_eq!(rebound.status(), 403);
    let step_down = app.url("/v1/streams/S/groups/g/members/m1/step-down");
    let cross_site = app.http.post(&step_down).header("origin", "https://evil.test").send().await.unwrap();
    assert_eq!(cross_site.status(), 403);
    // A sandboxed frame or a file: page sends the opaque origin "null".
    for path in ["/v1/streams/S/groups/g/members/m1/step-down", "/v1/streams/S/groups/g/partitions/0/skip"] {
        let opaque = app.http.post(app.url(path)).header("origin", "null").send().await.unwrap();
        assert_eq!(opaque.status(), 403, "{path}");
    }
    let own = app.base.clone();
    let same_site = app.http.post(&step_down).header("origin", own).send().await.unwrap();
    assert_ne!(same_site.status(), 403);
    assert_eq!(app.http.get(app.url("/v1/streams")).header("host", "localhost:1").send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn stream_limits_the_server_cannot_reserve_are_a_422_naming_the_field() {
    let app = TestApp::start().await;
    let (status, problem) =
        app.put("/v1/streams/BIG", json!({"subjects":["big.*"],"max_bytes":9223372036854775806i64})).await;
    assert_eq!(status, 422, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("max_bytes"), "{problem}");
}

/// No secret and no URL credential reaches a log line, even at debug level,
/// nor an event or a blocked partition's last error.
#[tokio::test]
async fn secrets_and_url_tokens_stay_out_of_debug_logs_and_errors() {
    let server = NatsServer::start();
    let log_path = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let log = std::fs::File::create(&log_path).unwrap();
    let keygate = KeygateProcess::start_logging(&server.url(), "kg-logs", "debug", &[], log.into());
    let http = http_client();
    keygate.wait_ready(&http).await;
    let put = |path: &str, body: Value| http.put(format!("{}{path}", keygate.base)).json(&body).send();
    assert_eq!(put("/v1/streams/S", json!({"subjects":["s.*"],"partitions":1})).await.unwrap().status(), 201);
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":2000});
    assert_eq!(put("/v1/streams/S/groups/g", group).await.unwrap().status(), 201);
    let secret = "whsec_c2VjcmV0LW9mLXRoZS1zaWduaW5nLWtleQ==";
    // Nothing listens on port 9: every delivery fails with a connection error.
    let hook = json!({"url":"http://127.0.0.1:9/hook?token=QUERYTOKEN42","secret":secret,"max_attempts":2});
    assert_eq!(put("/v1/streams/S/groups/g/members/m1/webhook", hook).await.unwrap().status(), 201);
    let mut events = http.get(format!("{}/v1/events", keygate.base)).send().await.unwrap();
    http.post(format!("{}/v1/streams/S/messages", keygate.base))
        .json(&json!({"key":"k","data":1}))
        .send()
        .await
        .unwrap();
    let view = eventually(Duration::from_secs(20), || async {
        let view: Value =
            http.get(format!("{}/v1/streams/S/groups/g", keygate.base)).send().await.ok()?.json().await.ok()?;
        view["blocked"].as_array().filter(|b| !b.is_empty()).map(|_| view.clone())
    })
    .await;
    let mut event_text = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Ok(Some(chunk)) = events.chunk().await {
            event_text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(event_text.contains("message.naked"), "events were read: {event_text}");
    // After its second attempt the message is dead-lettered with the reason.
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let dead_letter = eventually(Duration::from_secs(30), || async {
        let mut stream = js.get_stream("KEYGATE_DEAD_LETTERS").await.ok()?;
        (stream.info().await.ok()?.state.messages > 0).then_some(())?;
        stream.get_raw_message(1).await.ok()
    })
    .await;
    let dead_letter_headers: String =
        dead_letter.headers.iter().map(|(n, v)| format!("{n}: {v:?}\n")).collect::<String>();
    assert!(dead_letter_headers.contains("keygate-reason"), "{dead_letter_headers}");
    drop(keygate);
    let logged = std::fs::read_to_string(&log_path).unwrap();
    assert!(logged.contains("registration update"), "the log is at debug level");
    let view_text = view.to_string();
    for leaked in [secret, "c2VjcmV0LW9mLXRoZS1zaWduaW5nLWtleQ", "QUERYTOKEN42"] {
        assert!(!logged.contains(leaked), "{leaked} in the debug log");
        assert!(!view_text.contains(leaked), "{leaked} in the group view: {view_text}");
        assert!(!event_text.contains(leaked), "{leaked} in an event");
        assert!(!dead_letter_headers.contains(leaked), "{leaked} in the dead letter: {dead_letter_headers}");
    }
}

#[tokio::test]
async fn a_member_gets_at_most_its_share_of_websocket_connections() {
    let app = TestApp::start_with(|s| s.ws_max_connections_per_member = 1).await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    let url = member_url(&app.base, "S", "g", "m1", "");
    let mut first = WsClient::connect(&url).await;
    first.next_of("assigned", WAIT).await;
    match WsClient::connect_with(&url, &[]).await {
        Ok(_) => panic!("a second connection of m1 was accepted"),
        Err(status) => assert_eq!(status, 429),
    }
    first.close().await;
    // The slot is free again once the first connection is gone.
    eventually(WAIT, || async { WsClient::connect_with(&url, &[]).await.ok() }).await;
}

#[tokio::test]
async fn a_request_that_outlives_its_limit_answers_503_but_streams_do_not() {
    let setup = TestApp::start().await;
    stream_and_group(&setup, "g", json!(["m1"])).await;
    // m1's consumer pinned by a client outside keygate, and m1's control
    // subject heard by someone who never answers: the group view asks the
    // pin holder for its status and waits out the 750 ms timeout, so it
    // always outlives a 50 ms limit, however fast the machine.
    pin_from_outside(&setup, "g-m1").await;
    let _silent = setup.nats.subscribe("keygate.control.S.g.m1").await.unwrap();
    setup.nats.flush().await.unwrap();
    let app = TestApp::start_on_with(setup.nats_url.clone(), |s| s.request_timeout = Duration::from_millis(50)).await;
    let (status, problem) = app.get("/v1/streams/S/groups/g").await;
    assert_eq!(status, 503, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("took longer"), "{problem}");
    // The event stream is exempt: it answers 200 and stays open.
    let mut events = app.http.get(app.url("/v1/events")).send().await.unwrap();
    assert_eq!(events.status(), 200);
    let read = tokio::time::timeout(Duration::from_millis(300), events.chunk()).await;
    assert!(!matches!(read, Ok(Ok(None)) | Ok(Err(_))), "the event stream ended within the limit: {read:?}");
}

/// Creates `consumer` as a member's (priority group `PCG`, pinned client)
/// and takes its pin with a raw pull, as a client outside keygate.
async fn pin_from_outside(app: &TestApp, consumer: &str) {
    use async_nats::jetstream::consumer;
    let stream = app.js.get_stream("S").await.unwrap();
    let config = consumer::pull::Config {
        durable_name: Some(consumer.to_owned()),
        ack_policy: consumer::AckPolicy::Explicit,
        priority_groups: vec!["PCG".into()],
        priority_policy: consumer::PriorityPolicy::PinnedClient,
        priority_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    stream.create_consumer(config).await.unwrap();
    assert_eq!(app.post("/v1/streams/S/messages", json!({"key":"k","data":1})).await.0, 200);
    use futures::StreamExt as _;
    let inbox = app.nats.new_inbox();
    let mut answers = app.nats.subscribe(inbox.clone()).await.unwrap();
    let request = json!({"batch": 1, "expires": 2_000_000_000u64, "group": "PCG"});
    let subject = format!("$JS.API.CONSUMER.MSG.NEXT.S.{consumer}");
    app.nats.publish_with_reply(subject, inbox, request.to_string().into()).await.unwrap();
    let answer = tokio::time::timeout(WAIT, answers.next()).await.unwrap().unwrap();
    assert!(
        answer.headers.as_ref().and_then(|h| h.get("Nats-Pin-Id")).is_some(),
        "pinned from outside: {:?} {:?}",
        answer.status,
        answer.description
    );
}

/// A publisher's credentials headers never reach the webhook (the signature
/// does not cover headers, so an endpoint trusting them would act for
/// whoever published); its other headers do.
#[tokio::test]
async fn credentials_headers_of_a_message_are_not_forwarded_to_the_webhook() {
    let app = TestApp::start().await;
    stream_and_group(&app, "g", json!(["m1"])).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    assert_eq!(app.put("/v1/streams/S/groups/g/members/m1/webhook", json!({"url": receiver.url("/m1")})).await.0, 201);
    let headers = json!({"Authorization":"Bearer stolen","Cookie":"session=stolen","Proxy-Authorization":"Basic x",
        "X-Trace":"t-1"});
    let (status, answer) = app.post("/v1/streams/S/messages", json!({"key":"k","data":1,"headers":headers})).await;
    assert_eq!(status, 200, "{answer}");
    let delivered = eventually(WAIT, || async { receiver.requests().into_iter().find(|r| r.ok()) }).await;
    assert_eq!(delivered.header("x-trace"), Some("t-1"), "other headers are forwarded");
    for name in ["authorization", "cookie", "proxy-authorization"] {
        assert_eq!(delivered.header(name), None, "{name} was forwarded");
    }
    app.assert_no_acks_without_verdict().await;
}

/// At most `max_connections` are served at once; a further client waits in
/// the accept queue until one closes, and is then served.
#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let app = TestApp::start_with(|s| s.max_connections = 2).await;
    let address = app.base.trim_start_matches("http://").to_owned();
    let request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let answered = |mut tcp: tokio::net::TcpStream, limit: Duration| async move {
        tcp.write_all(request).await.unwrap();
        let mut buffer = [0u8; 256];
        let read = tokio::time::timeout(limit, tcp.read(&mut buffer)).await;
        let ok = matches!(read, Ok(Ok(n)) if n > 0 && buffer.starts_with(b"HTTP/1.1 200"));
        (ok, tcp)
    };
    // Keep-alive connections count, the test client's pooled one too: open
    // raw ones until one is not served.
    let mut held = Vec::new();
    let waiting = loop {
        let tcp = tokio::net::TcpStream::connect(&address).await.unwrap();
        let (ok, tcp) = answered(tcp, Duration::from_millis(500)).await;
        if !ok {
            break tcp;
        }
        held.push(tcp);
        assert!(held.len() <= 2, "more connections served than the cap");
    };
    assert!(!held.is_empty(), "connections within the cap are served");
    drop(held.pop());
    let mut waiting = waiting;
    let mut buffer = [0u8; 256];
    let read = tokio::time::timeout(WAIT, waiting.read(&mut buffer)).await;
    assert!(matches!(read, Ok(Ok(n)) if n > 0 && buffer.starts_with(b"HTTP/1.1 200")), "served once one closed");
}
