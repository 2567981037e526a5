//! Plain consumers with priority-group policies, against a real nats-server.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

use crate::support::TestApp;

async fn setup(app: &TestApp) {
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
}

/// One raw pull (`$JS.API.CONSUMER.MSG.NEXT`) with `options`; the first
/// answer: a message (`Some(subject, pin id)`) or a status (`None`).
async fn pull(app: &TestApp, consumer: &str, options: Value) -> Option<(String, Option<String>)> {
    let inbox = app.nats.new_inbox();
    let mut answers = app.nats.subscribe(inbox.clone()).await.unwrap();
    let subject = format!("$JS.API.CONSUMER.MSG.NEXT.JOBS.{consumer}");
    app.nats.publish_with_reply(subject, inbox, options.to_string().into()).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), answers.next()).await.ok()??;
    if answer.status.is_some() {
        return None;
    }
    let pin = answer.headers.as_ref().and_then(|h| h.get("Nats-Pin-Id")).map(|v| v.to_string());
    Some((answer.subject.to_string(), pin))
}

#[tokio::test]
async fn consumers_are_created_confirmed_updated_and_deleted_as_the_server_holds_them() {
    let app = TestApp::start().await;
    setup(&app).await;
    let body = json!({"policy":"pinned_client","group":"workers","pinned_ttl_ms":5000,"ack_wait_ms":10000,"max_ack_pending":50,"filter_subjects":["jobs.*"]});
    let (status, view) = app.put("/v1/streams/JOBS/consumers/c1", body.clone()).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["policy"], "pinned_client");
    assert_eq!(view["group"], "workers");
    assert_eq!(view["pinned_ttl_ms"], 5000);
    let info = app.js.get_stream("JOBS").await.unwrap().consumer_info("c1").await.unwrap();
    assert_eq!(info.config.priority_policy, async_nats::jetstream::consumer::PriorityPolicy::PinnedClient);
    assert_eq!(info.config.priority_groups, vec!["workers".to_owned()]);
    assert_eq!(info.config.priority_timeout, Duration::from_secs(5));
    assert_eq!(info.config.max_ack_pending, 50);
    assert_eq!(app.put("/v1/streams/JOBS/consumers/c1", body.clone()).await.0, 200, "the same PUT confirms");
    let mut changed = body.clone();
    changed["ack_wait_ms"] = json!(20000);
    let (status, view) = app.put("/v1/streams/JOBS/consumers/c1", changed).await;
    assert_eq!((status, view["ack_wait_ms"].clone()), (200, json!(20000)));
    let (status, view) = app.get("/v1/streams/JOBS/consumers/c1").await;
    assert_eq!(status, 200);
    assert_eq!(view["num_pending"], 0);
    assert_eq!(app.delete("/v1/streams/JOBS/consumers/c1").await.0, 204);
    assert_eq!(app.get("/v1/streams/JOBS/consumers/c1").await.0, 404);
    assert_eq!(app.get("/v1/streams/NOPE/consumers/c1").await.0, 404);
}

#[tokio::test]
async fn invalid_consumers_are_refused_before_anything_is_created() {
    let app = TestApp::start().await;
    setup(&app).await;
    for (body, says) in [
        (json!({"policy":"overflow"}), "needs a group"),
        (json!({"group":"jobs"}), "needs a policy"),
        (json!({"policy":"prioritized","group":"seventeen-chars-x"}), "16 characters"),
        (json!({"policy":"overflow","group":"g","pinned_ttl_ms":1000}), "pinned_client policy only"),
        (json!({"policy":"sticky","group":"g"}), "unknown variant"),
        (json!({"max_ack_pending":0}), "max_ack_pending"),
    ] {
        let (status, problem) = app.put("/v1/streams/JOBS/consumers/bad", body.clone()).await;
        assert_eq!(status, 400, "{body}: {problem}");
        assert!(problem["detail"].as_str().unwrap().contains(says), "{body}: {problem}");
    }
    // A filter matching nothing the stream stores (the server would accept it) is a 422.
    let (status, problem) = app.put("/v1/streams/JOBS/consumers/bad", json!({"filter_subjects":["other.*"]})).await;
    assert_eq!(status, 422, "{problem}");
    assert!(app.js.get_stream("JOBS").await.unwrap().consumer_info("bad").await.is_err(), "nothing was created");
}

#[tokio::test]
async fn a_pinned_client_consumer_pins_one_puller_and_unpin_releases_it() {
    let app = TestApp::start().await;
    setup(&app).await;
    let (status, _) = app.put("/v1/streams/JOBS/consumers/c", json!({"policy":"pinned_client","group":"g"})).await;
    assert_eq!(status, 201);
    for n in 0..3 {
        app.js.publish(format!("jobs.{n}"), "x".into()).await.unwrap().await.unwrap();
    }
    let (_, pin) = pull(&app, "c", json!({"batch":1,"expires":1_000_000_000u64,"group":"g"})).await.unwrap();
    let pin = pin.expect("the first puller is pinned");
    let (_, view) = app.get("/v1/streams/JOBS/consumers/c").await;
    assert_eq!(view["pinned_client_id"], pin.as_str());
    assert!(view["pinned_since"].is_string());
    let (status, view) = app.post("/v1/streams/JOBS/consumers/c/unpin", json!({})).await;
    assert_eq!(status, 200, "{view}");
    assert!(view["pinned_client_id"].is_null(), "{view}");
    let (_, next_pin) = pull(&app, "c", json!({"batch":1,"expires":1_000_000_000u64,"group":"g"})).await.unwrap();
    assert_ne!(next_pin.unwrap(), pin, "the next pull is pinned anew");
    // Unpin is for pinned_client consumers only.
    app.put("/v1/streams/JOBS/consumers/plain", json!({})).await;
    assert_eq!(app.post("/v1/streams/JOBS/consumers/plain/unpin", json!({})).await.0, 409);
}

#[tokio::test]
async fn an_overflow_consumer_serves_a_pull_only_above_its_min_pending() {
    let app = TestApp::start().await;
    setup(&app).await;
    let (status, _) = app.put("/v1/streams/JOBS/consumers/far", json!({"policy":"overflow","group":"g"})).await;
    assert_eq!(status, 201);
    for n in 0..5 {
        app.js.publish(format!("jobs.{n}"), "x".into()).await.unwrap().await.unwrap();
    }
    let far_region = json!({"batch":1,"expires":300_000_000u64,"group":"g","min_pending":10});
    assert!(pull(&app, "far", far_region.clone()).await.is_none(), "5 pending: below the threshold, nothing");
    for n in 5..12 {
        app.js.publish(format!("jobs.{n}"), "x".into()).await.unwrap().await.unwrap();
    }
    assert!(pull(&app, "far", far_region).await.is_some(), "12 pending: the overflow is served");
}

#[tokio::test]
async fn a_group_members_consumer_is_managed_through_its_group() {
    let app = TestApp::start().await;
    setup(&app).await;
    let handle = app.js.get_stream("JOBS").await.unwrap();
    handle
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("g-m1".into()),
            priority_policy: async_nats::jetstream::consumer::PriorityPolicy::PinnedClient,
            priority_groups: vec!["PCG".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(app.put("/v1/streams/JOBS/consumers/g-m1", json!({})).await.0, 409);
    assert_eq!(app.delete("/v1/streams/JOBS/consumers/g-m1").await.0, 409);
}

async fn publish_jobs(app: &TestApp, from: u64, count: u64) {
    for n in from..from + count {
        app.js.publish(format!("jobs.{n}"), format!("{{\"n\":{n}}}").into()).await.unwrap().await.unwrap();
    }
}

/// Waits until `n` pull requests wait at the consumer (its subscribers run).
async fn pulling(app: &TestApp, consumer: &str, n: usize) {
    crate::support::eventually(Duration::from_secs(15), || async {
        let info = app.js.get_stream("JOBS").await.ok()?.consumer_info(consumer).await.ok()?;
        (info.num_waiting >= n).then_some(())
    })
    .await;
}

async fn subscribe(app: &TestApp, consumer: &str, subscriber: &str, url: String, options: Value) -> Value {
    let mut body = options;
    body["url"] = json!(url);
    let (status, view) =
        app.put(&format!("/v1/streams/JOBS/consumers/{consumer}/subscribers/{subscriber}/webhook"), body).await;
    assert_eq!(status, 201, "{view}");
    view
}

#[tokio::test]
async fn an_overflow_subscriber_idles_below_its_threshold_and_is_served_above_it() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    setup(&app).await;
    app.put("/v1/streams/JOBS/consumers/far", json!({"policy":"overflow","group":"g"})).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let view = subscribe(&app, "far", "eu", receiver.url("/jobs"), json!({"min_pending": 10})).await;
    assert_eq!(view["options"]["min_pending"], 10);
    publish_jobs(&app, 0, 5).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(receiver.requests().is_empty(), "5 waiting: below the far region's threshold");
    publish_jobs(&app, 5, 15).await;
    crate::support::eventually(Duration::from_secs(15), || async {
        (receiver.requests().iter().filter(|r| r.ok()).count() >= 5).then_some(())
    })
    .await;
    let first = &receiver.requests()[0];
    assert_eq!(first.header("keygate-group"), Some("far"));
    assert_eq!(first.header("keygate-member"), Some("eu"));
    assert!(first.header("webhook-signature").is_some());
    // Pull options must fit the policy.
    let (status, _) = app
        .put("/v1/streams/JOBS/consumers/far/subscribers/x/webhook", json!({"url": receiver.url("/x"), "priority": 1}))
        .await;
    assert_eq!(status, 400);
    // Deleting the consumer removes its subscribers.
    assert_eq!(app.get("/v1/streams/JOBS/consumers/far/subscribers/eu/webhook").await.0, 200);
    assert_eq!(app.delete("/v1/streams/JOBS/consumers/far").await.0, 204);
    assert_eq!(app.get("/v1/streams/JOBS/consumers/far/subscribers/eu/webhook").await.0, 404);
}

#[tokio::test]
async fn prioritized_subscribers_are_served_lowest_priority_first_and_the_next_takes_over() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    setup(&app).await;
    app.put("/v1/streams/JOBS/consumers/pri", json!({"policy":"prioritized","group":"g"})).await;
    let near = Receiver::start(|_, _| Answer::ok()).await;
    let far = Receiver::start(|_, _| Answer::ok()).await;
    subscribe(&app, "pri", "near", near.url("/n"), json!({"priority": 0, "concurrency": 2})).await;
    subscribe(&app, "pri", "far", far.url("/f"), json!({"priority": 5})).await;
    pulling(&app, "pri", 2).await;
    publish_jobs(&app, 0, 20).await;
    crate::support::eventually(Duration::from_secs(15), || async {
        (near.requests().iter().filter(|r| r.ok()).count() == 20).then_some(())
    })
    .await;
    assert!(far.requests().is_empty(), "priority 5 waits while 0 pulls");
    // Priority 0 stops pulling: 5 takes over.
    assert_eq!(app.delete("/v1/streams/JOBS/consumers/pri/subscribers/near/webhook").await.0, 204);
    crate::support::eventually(Duration::from_secs(15), || async {
        let info = app.js.get_stream("JOBS").await.ok()?.consumer_info("pri").await.ok()?;
        (info.num_waiting == 1).then_some(())
    })
    .await;
    publish_jobs(&app, 20, 10).await;
    crate::support::eventually(Duration::from_secs(15), || async {
        (far.requests().iter().filter(|r| r.ok()).count() == 10).then_some(())
    })
    .await;
    let info = app.js.get_stream("JOBS").await.unwrap().consumer_info("pri").await.unwrap();
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_pending, 0, "nothing lost");
}

/// The "hierarchy of regions" use: while priority 0 keeps up with a
/// sustained burst, priority 5 gets nothing (its pulls are always behind a
/// waiting pull of priority 0). Two keygate replicas, as in production.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_five_stays_idle_while_priority_zero_keeps_up_with_a_sustained_burst() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    let _replica = TestApp::start_on(app.nats_url.clone()).await;
    setup(&app).await;
    app.put("/v1/streams/JOBS/consumers/pri", json!({"policy":"prioritized","group":"g"})).await;
    let near = Receiver::start(|_, _| Answer::ok()).await;
    let far = Receiver::start(|_, _| Answer::ok()).await;
    subscribe(&app, "pri", "near", near.url("/n"), json!({"priority": 0})).await;
    subscribe(&app, "pri", "far", far.url("/f"), json!({"priority": 5})).await;
    pulling(&app, "pri", 4).await;
    const BURST: u64 = 300;
    for round in 0..3 {
        let jobs: Vec<_> = (0..BURST)
            .map(|i| {
                let n = round * BURST + i;
                app.js.publish(format!("jobs.{n}"), format!("{{\"n\":{n}}}").into())
            })
            .collect();
        for ack in futures::future::join_all(jobs).await {
            ack.unwrap().await.unwrap();
        }
        crate::support::eventually(Duration::from_secs(30), || async {
            let served = near.requests().iter().filter(|r| r.ok()).count() + far.requests().len();
            (served as u64 >= (round + 1) * BURST).then_some(())
        })
        .await;
    }
    crate::support::eventually(Duration::from_secs(30), || async {
        let served = near.requests().iter().filter(|r| r.ok()).count() + far.requests().len();
        (served as u64 >= 3 * BURST).then_some(())
    })
    .await;
    assert_eq!(far.requests().len(), 0, "priority 5 was served while priority 0 kept up");
    app.assert_no_acks_without_verdict().await;
}

/// Spearman's rank correlation of two orders of the same items.
fn rank_correlation(order: &[u64]) -> f64 {
    let mut by_value: Vec<(usize, u64)> = order.iter().copied().enumerate().collect();
    by_value.sort_by_key(|(_, v)| *v);
    let n = order.len() as f64;
    let d2: f64 =
        by_value.iter().enumerate().map(|(rank, (position, _))| (rank as f64 - *position as f64).powi(2)).sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

#[tokio::test]
async fn shuffling_breaks_publish_order_within_its_window_and_loses_nothing() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    setup(&app).await;
    let shuffle = json!({"probability":0.5,"min_delay_ms":50,"max_delay_ms":400,"max_window":40});
    let (status, view) =
        app.put("/v1/streams/JOBS/consumers/mix", json!({"shuffle": shuffle, "max_ack_pending": 100})).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["shuffle"], shuffle);
    assert_eq!(view["max_ack_pending"], 140, "raised above the window");
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    subscribe(&app, "mix", "w", receiver.url("/w"), json!({"concurrency": 1})).await;
    pulling(&app, "mix", 1).await;
    // A new subscriber instance takes its share of the window only after
    // the longest delay plus one renewal (delays granted before it may run).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    publish_jobs(&app, 0, 300).await;
    let series = r#"keygate_shuffle_window_messages{stream="JOBS",consumer="mix"}"#;
    let mut peak = 0.0f64;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        if let Some(v) = text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok()) {
            peak = peak.max(v);
        }
        let acked: std::collections::HashSet<u64> =
            receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        if acked.len() == 300 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "only {} of 300 delivered", acked.len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut seen = std::collections::HashSet::new();
    let order: Vec<u64> =
        receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).filter(|s| seen.insert(*s)).collect();
    let rho = rank_correlation(&order);
    println!("shuffle: rank correlation between publish and processing order {rho:.3} (1 = publish order); window peak {peak}");
    assert!(rho < 0.97, "order measurably broken: rho {rho}");
    assert!(peak <= 40.0 && peak > 0.0, "window peak {peak}");
    // The receiver's last answer may be a moment ahead of keygate's ack of it.
    let consumer = app.js.get_stream("JOBS").await.unwrap();
    crate::support::eventually(Duration::from_secs(10), || async {
        let info = consumer.clone().consumer_info("mix").await.ok()?;
        ((info.num_pending, info.num_ack_pending) == (0, 0)).then_some(())
    })
    .await;
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_pinned_client_subscriber_fails_over_to_the_other_replica_after_the_pin_ttl() {
    use crate::support::receiver::{Answer, Receiver};
    use crate::support::{http_client, KeygateProcess, NatsServer};
    let server = NatsServer::start();
    let http = http_client();
    let mut replicas = vec![KeygateProcess::start(&server.url(), "kg-a"), KeygateProcess::start(&server.url(), "kg-b")];
    for r in &replicas {
        r.wait_ready(&http).await;
    }
    let nats = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(nats.clone());
    let mut pinned_events = nats.subscribe("keygate.events.JOBS.pinc.w.member.pinned").await.unwrap();
    let api = |path: &str| format!("{}{}", replicas[0].base, path);
    http.put(api("/v1/streams/JOBS")).json(&json!({"subjects":["jobs.*"]})).send().await.unwrap();
    let consumer = json!({"policy":"pinned_client","group":"g","pinned_ttl_ms":1500});
    assert_eq!(http.put(api("/v1/streams/JOBS/consumers/pinc")).json(&consumer).send().await.unwrap().status(), 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/w")});
    let r = http.put(api("/v1/streams/JOBS/consumers/pinc/subscribers/w/webhook")).json(&hook).send().await.unwrap();
    assert_eq!(r.status(), 201);
    for n in 0..10 {
        js.publish(format!("jobs.{n}"), "x".into()).await.unwrap().await.unwrap();
    }
    let first: Value = serde_json::from_slice(
        &tokio::time::timeout(Duration::from_secs(15), pinned_events.next()).await.unwrap().unwrap().payload,
    )
    .unwrap();
    crate::support::eventually(Duration::from_secs(15), || async {
        (receiver.requests().iter().filter(|r| r.ok()).count() >= 10).then_some(())
    })
    .await;
    let tokens: std::collections::HashSet<u64> = receiver.requests().iter().map(|r| r.fencing()).collect();
    assert_eq!(tokens.len(), 1, "one pinned replica delivered everything: {tokens:?}");
    // Kill the pinned replica: no unpin; the server re-pins after the TTL.
    let pinned = if first["instance"] == "kg-a" { 0 } else { 1 };
    replicas[pinned].kill();
    for n in 10..20 {
        js.publish(format!("jobs.{n}"), "x".into()).await.unwrap().await.unwrap();
    }
    let second: Value = serde_json::from_slice(
        &tokio::time::timeout(Duration::from_secs(15), pinned_events.next()).await.unwrap().unwrap().payload,
    )
    .unwrap();
    assert_ne!(second["instance"], first["instance"], "the other replica took over");
    assert!(second["fencing_token"].as_u64() > first["fencing_token"].as_u64());
    crate::support::eventually(Duration::from_secs(15), || async {
        let acked: std::collections::HashSet<u64> =
            receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        (acked.len() == 20).then_some(())
    })
    .await;
}

#[tokio::test]
async fn the_shuffle_window_is_shared_by_every_replica_running_the_subscriber() {
    use crate::support::receiver::{Answer, Receiver};
    use crate::support::{http_client, KeygateProcess, NatsServer};
    let server = NatsServer::start();
    let http = http_client();
    let replicas = [KeygateProcess::start(&server.url(), "kg-a"), KeygateProcess::start(&server.url(), "kg-b")];
    for r in &replicas {
        r.wait_ready(&http).await;
    }
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let api = |path: &str| format!("{}{}", replicas[0].base, path);
    http.put(api("/v1/streams/JOBS")).json(&json!({"subjects":["jobs.*"]})).send().await.unwrap();
    let shuffle = json!({"probability":1.0,"min_delay_ms":300,"max_delay_ms":600,"max_window":30});
    let r = http.put(api("/v1/streams/JOBS/consumers/mix")).json(&json!({"shuffle": shuffle})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/w"), "concurrency": 2});
    let r = http.put(api("/v1/streams/JOBS/consumers/mix/subscribers/w/webhook")).json(&hook).send().await.unwrap();
    assert_eq!(r.status(), 201);
    // Both replicas announce themselves and settle on half the window each.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for n in 0..300 {
        js.publish(format!("jobs.{n}"), "x".into()).await.unwrap();
    }
    let series = r#"keygate_shuffle_window_messages{stream="JOBS",consumer="mix"}"#;
    let (mut peak_sum, mut peaks) = (0.0f64, [0.0f64; 2]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut sum = 0.0;
        for (i, r) in replicas.iter().enumerate() {
            let text = http.get(format!("{}/metrics", r.base)).send().await.unwrap().text().await.unwrap();
            let v = text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok()).unwrap_or(0.0);
            peaks[i] = peaks[i].max(v);
            sum += v;
        }
        peak_sum = peak_sum.max(sum);
        let acked: std::collections::HashSet<u64> =
            receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        if acked.len() == 300 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "only {} of 300 delivered", acked.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("shuffle window across two replicas: peak sum {peak_sum}, per replica {peaks:?}");
    assert!(peak_sum <= 30.0, "the consumer-wide window holds: {peak_sum}");
    assert!(peaks.iter().all(|p| *p <= 15.0), "each takes its share: {peaks:?}");
}

#[tokio::test]
async fn a_subscriber_keeps_a_numeric_first_token_of_an_unstamped_stream_in_the_subject() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    app.create_stream("NUM", json!({"subjects":["7.*"]})).await;
    assert_eq!(app.put("/v1/streams/NUM/consumers/c", json!({})).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/n")});
    assert_eq!(app.put("/v1/streams/NUM/consumers/c/subscribers/s/webhook", hook).await.0, 201);
    app.js.publish("7.a", "x".into()).await.unwrap().await.unwrap();
    let request =
        crate::support::eventually(Duration::from_secs(15), || async { receiver.requests().into_iter().next() }).await;
    assert_eq!(request.header("keygate-subject"), Some("7.a"), "7 is part of the subject, not a partition");
    assert_eq!(request.header("keygate-partition"), Some("0"));
}

/// A server that restarts forgets the pulls waiting on it. A subscriber,
/// like a group member, pulls again as soon as keygate has reconnected, not
/// when its forgotten pull would have ended (what the pull's own `expires`
/// says, watched on the pull subject).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_pulls_again_as_soon_as_keygate_reconnects_to_a_restarted_server() {
    use crate::support::receiver::{Answer, Receiver};
    let mut app = TestApp::start().await;
    setup(&app).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/work", json!({"policy":"overflow","group":"g"})).await.0, 201);
    let mut pulls = app.nats.subscribe("$JS.API.CONSUMER.MSG.NEXT.JOBS.work").await.unwrap();
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    subscribe(&app, "work", "w", receiver.url("/w"), json!({})).await;
    // The next pull seen is one the subscriber sends now.
    let pull = tokio::time::timeout(Duration::from_secs(15), pulls.next()).await.unwrap().unwrap();
    let sent = std::time::Instant::now();
    let request: Value = serde_json::from_slice(&pull.payload).unwrap();
    let forgotten_pull_ends = sent + Duration::from_nanos(request["expires"].as_u64().unwrap());
    let server = app.nats_server.as_mut().unwrap();
    tokio::task::block_in_place(|| server.restart());
    let restarted = std::time::Instant::now();
    crate::support::eventually(Duration::from_secs(15), || async {
        let info = app.js.get_stream("JOBS").await.ok()?.consumer_info("work").await.ok()?;
        (info.num_waiting > 0).then_some(())
    })
    .await;
    let pulled_again = std::time::Instant::now();
    println!(
        "pulled again {:.2} s after the restart; the forgotten pull would have ended {:.2} s after it",
        (pulled_again - restarted).as_secs_f64(),
        forgotten_pull_ends.saturating_duration_since(restarted).as_secs_f64()
    );
    assert!(pulled_again < forgotten_pull_ends, "the subscriber waited for its forgotten pull to end");
    publish_jobs(&app, 0, 1).await;
    crate::support::eventually(Duration::from_secs(15), || async {
        receiver.requests().iter().any(|r| r.ok()).then_some(())
    })
    .await;
}

/// A pinned subscriber that hears nothing from the server (its connection
/// up, the server's bytes held back) cannot see the pin move: it steps down
/// on its own within the pin's TTL, as a group member does, and takes the
/// pin again once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_subscriber_steps_down_when_the_server_goes_quiet() {
    use crate::support::proxy::CuttableProxy;
    use crate::support::receiver::{Answer, Receiver};
    use crate::support::NatsServer;
    let server = NatsServer::start();
    let proxy = CuttableProxy::start(format!("127.0.0.1:{}", server.url().rsplit(':').next().unwrap())).await;
    let app = TestApp::start_through(server, proxy.url()).await;
    setup(&app).await;
    // A short ack wait: a message the server sends to a pull forgotten in
    // the cut comes back soon.
    let consumer = json!({"policy":"pinned_client","group":"g","pinned_ttl_ms":3000,"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/JOBS/consumers/quiet", consumer).await.0, 201);
    // Events reach the test's own client, which connects straight to the server.
    let mut events = app.nats.subscribe("keygate.events.JOBS.quiet.w.>").await.unwrap();
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    subscribe(&app, "quiet", "w", receiver.url("/w"), json!({})).await;
    publish_jobs(&app, 0, 1).await;
    next_event(&mut events, "member.pinned", Duration::from_secs(15)).await;
    proxy.hold_server_bytes();
    let quiet = std::time::Instant::now();
    let unpinned = next_event(&mut events, "member.unpinned", Duration::from_secs(10)).await;
    println!("stepped down {:.2} s after the server went quiet", quiet.elapsed().as_secs_f64());
    assert_eq!(unpinned["reason"], "no word from the server within the pin's TTL", "{unpinned}");
    proxy.cut();
    publish_jobs(&app, 1, 1).await;
    next_event(&mut events, "member.pinned", Duration::from_secs(20)).await;
    crate::support::eventually(Duration::from_secs(20), || async {
        let acked: std::collections::HashSet<u64> =
            receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        (acked.len() == 2).then_some(())
    })
    .await;
}

/// The next event of type `wanted` on `events`; panics after `within`.
async fn next_event(events: &mut async_nats::Subscriber, wanted: &str, within: Duration) -> Value {
    tokio::time::timeout(within, async {
        while let Some(event) = events.next().await {
            let event: Value = serde_json::from_slice(&event.payload).unwrap();
            if event["type"] == wanted {
                return event;
            }
        }
        panic!("events ended");
    })
    .await
    .unwrap_or_else(|_| panic!("no {wanted} event within {within:?}"))
}

/// A subscriber's endpoint that answers 410 Gone asked to stop, as a
/// member's does: it is not served any more and its registration is gone.
#[tokio::test]
async fn a_subscriber_whose_webhook_answers_410_is_deregistered() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    setup(&app).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/gone", json!({"policy":"none"})).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::status(410)).await;
    subscribe(&app, "gone", "w", receiver.url("/w"), json!({})).await;
    publish_jobs(&app, 0, 3).await;
    let path = "/v1/streams/JOBS/consumers/gone/subscribers/w/webhook";
    crate::support::eventually(Duration::from_secs(15), || async { (app.get(path).await.0 == 404).then_some(()) })
        .await;
    let answered = receiver.requests().len();
    assert!(answered >= 1, "the endpoint was asked");
    publish_jobs(&app, 3, 3).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(receiver.requests().len(), answered, "nothing was delivered after the 410");
}
