//! The cg-style admin commands, run as the real binary against a real nats-server.

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

use crate::support::TestApp;

fn keygate(app: &TestApp, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keygate")).args(args).args(["--nats-url", &app.nats_url]).output().unwrap()
}

/// Runs a command that must succeed; returns its standard output.
fn ok(app: &TestApp, args: &[&str]) -> String {
    let out = keygate(app, args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn json_of(app: &TestApp, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    serde_json::from_str(&ok(app, &all)).unwrap()
}

#[tokio::test]
async fn static_groups_made_by_the_cli_are_what_pcgroups_stores_and_what_the_api_serves() {
    let app = TestApp::start().await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":4})).await;
    let created = ok(&app, &["static", "create", "balanced", "ORDERS", "g", "4", "m1", "m2", "--filter", "orders.*"]);
    assert!(created.contains("created static group ORDERS/g with 4 partitions"), "{created}");
    let stored = app.kv_raw("static-consumer-groups", "ORDERS.g").await.unwrap();
    assert_eq!(String::from_utf8(stored).unwrap(), r#"{"max_members":4,"filters":["orders.*"],"members":["m1","m2"]}"#);
    let (status, view) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 200);
    assert_eq!(view["members"], json!(["m1", "m2"]));

    let mapped = ok(&app, &["static", "create", "mapped", "ORDERS", "h", "4", "a:0,1", "b:2,3"]);
    assert!(mapped.contains("a: partitions 0-1") && mapped.contains("b: partitions 2-3"), "{mapped}");
    assert_eq!(ok(&app, &["static", "ls", "ORDERS"]).trim(), "static groups on stream ORDERS: g, h");
    assert_eq!(json_of(&app, &["static", "ls", "ORDERS"]), json!(["g", "h"]));

    let info = ok(&app, &["static", "info", "ORDERS", "g"]);
    assert!(info.contains("static group ORDERS/g: 4 partitions"), "{info}");
    assert!(info.contains("MEMBER") && info.contains("m1") && info.contains("g-m1"), "{info}");
    let view = json_of(&app, &["static", "info", "ORDERS", "g"]);
    assert_eq!(view["partitions"], 4);
    assert_eq!(view["assignment"][0]["partitions"], json!([0, 1]));

    let member = ok(&app, &["static", "member-info", "ORDERS", "g", "m2"]);
    assert!(member.contains("member m2 is part of the group's membership, partitions 2-3"), "{member}");
    assert!(member.contains("NO active instance"), "{member}");
    let outsider = ok(&app, &["static", "minfo", "ORDERS", "g", "zed"]);
    assert!(outsider.contains("not part of"), "{outsider}");

    // Errors are one line on stderr and exit 1; nothing changes.
    let refused = keygate(&app, &["static", "create", "balanced", "ORDERS", "g", "8", "m1"]);
    assert_eq!(refused.status.code(), Some(1));
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(message.starts_with("keygate: ") && message.contains("delete and recreate"), "{message}");
    let no_consumer = keygate(&app, &["static", "step-down", "ORDERS", "g", "m1"]);
    assert_eq!(no_consumer.status.code(), Some(1));

    // Without --force the CLI asks, and anything but "y" keeps the group.
    let mut child = Command::new(env!("CARGO_BIN_EXE_keygate"))
        .args(["static", "rm", "ORDERS", "h", "--nats-url", &app.nats_url])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"n\n").unwrap();
    let kept = child.wait_with_output().unwrap();
    assert_eq!(kept.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&kept.stderr).contains("canceled"));
    assert_eq!(app.get("/v1/streams/ORDERS/groups/h").await.0, 200);
    assert!(ok(&app, &["static", "rm", "-f", "ORDERS", "h"]).contains("deleted static group ORDERS/h"));
    assert_eq!(app.get("/v1/streams/ORDERS/groups/h").await.0, 404);
}

#[tokio::test]
async fn elastic_membership_and_mappings_are_edited_live_from_the_cli() {
    let app = TestApp::start().await;
    app.create_stream("EVENTS", json!({"subjects":["events.*.*"]})).await;
    ok(
        &app,
        &[
            "elastic",
            "create",
            "EVENTS",
            "g",
            "6",
            "--filter",
            "events.*.*",
            "--wildcards",
            "2",
            "--max-buffered-msgs",
            "1000",
        ],
    );
    let stored: Value =
        serde_json::from_slice(&app.kv_raw("elastic-consumer-groups", "EVENTS.g").await.unwrap()).unwrap();
    assert_eq!(stored["partitioning_filters"], json!([{"filter":"events.*.*","partitioning_wildcards":[2]}]));
    assert_eq!(stored["max_buffered_msg"], 1000, "pcgroups' JSON name");

    let added = ok(&app, &["elastic", "add", "EVENTS", "g", "a", "b", "c"]);
    assert!(added.contains("members now: a, b, c"), "{added}");
    let dropped = json_of(&app, &["elastic", "drop", "EVENTS", "g", "b", "c"]);
    assert_eq!(dropped["members"], json!(["a"]));
    assert_eq!(dropped["ownership"][0]["partitions"], json!([0, 1, 2, 3, 4, 5]));
    let mapped = ok(&app, &["elastic", "create-mapping", "EVENTS", "g", "x:0,1,2", "y:3,4,5"]);
    assert!(mapped.contains("x: partitions 0-2"), "{mapped}");
    let (_, view) = app.get("/v1/streams/EVENTS/groups/g").await;
    assert_eq!(view["mappings"][1], json!({"member":"y","partitions":[3,4,5]}));
    let refused = keygate(&app, &["elastic", "delete-mapping", "EVENTS", "g"]);
    assert!(!refused.status.success(), "without members to take over: no partition would have an owner");
    let unmapped = json_of(&app, &["elastic", "delete-mapping", "EVENTS", "g", "x", "y"]);
    assert_eq!(unmapped["members"], json!(["x", "y"]));
    let info = ok(&app, &["elastic", "info", "EVENTS", "g"]);
    assert!(info.contains("partitioning filter: events.*.* wildcards [2]"), "{info}");
    assert!(info.contains("work-queue stream: EVENTS-g"), "{info}");
    assert_eq!(json_of(&app, &["elastic", "ls", "EVENTS"]), json!(["g"]));
    // A static listing does not show elastic groups.
    assert_eq!(json_of(&app, &["static", "ls", "EVENTS"]), json!([]));
    ok(&app, &["elastic", "rm", "--force", "EVENTS", "g"]);
    assert!(app.js.get_stream("EVENTS-g").await.is_err(), "the work-queue stream is deleted");
}

#[tokio::test]
async fn streams_ls_prints_partitions_messages_and_state() {
    let app = TestApp::start().await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":8})).await;
    app.create_stream("PLAIN", json!({"subjects":["plain.>"]})).await;
    for n in 0..3 {
        let (status, _) = app.post("/v1/streams/ORDERS/messages", json!({"key": format!("k{n}"), "data": n})).await;
        assert_eq!(status, 200);
    }
    let listing = ok(&app, &["streams", "ls"]);
    let orders = listing.lines().find(|l| l.trim_start().starts_with("ORDERS")).unwrap();
    let columns: Vec<&str> = orders.split_whitespace().collect();
    assert_eq!(columns[..5], ["ORDERS", "orders.*", "8", "3", columns[4]], "{listing}");
    assert!(orders.contains("1..3"), "{orders}");
    assert!(listing.lines().any(|l| l.trim_start().starts_with("PLAIN")), "{listing}");
    assert!(!listing.contains("KV_"), "{listing}");
    let json = json_of(&app, &["streams", "ls"]);
    assert_eq!(json[0]["name"], "ORDERS");
    assert_eq!(json[0]["messages"], 3);
    // An unreachable server is a clear error, not a hang.
    let down = Command::new(env!("CARGO_BIN_EXE_keygate"))
        .args(["streams", "ls", "--nats-url", "nats://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(down.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&down.stderr).contains("connecting to NATS"));
}

#[tokio::test]
async fn dlq_lists_shows_redrives_and_deletes_dead_letters() {
    use crate::dead_letters::{group_with_hook, ids, poison_receiver, publish, wait_for_letters};
    let app = TestApp::start().await;
    let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let receiver = poison_receiver(failing.clone()).await;
    group_with_hook(&app, &receiver).await;
    for n in 0..2 {
        publish(&app, "poison", n).await;
    }
    let letter_ids = ids(&wait_for_letters(&app, 2).await);

    let listed = ok(&app, &["dlq", "ls", "--stream", "K", "--group", "g"]);
    assert!(listed.contains("poison") && listed.contains("endpoint refused"), "{listed}");
    let page = json_of(&app, &["dlq", "ls", "--key", "poison", "--limit", "1"]);
    assert_eq!(page["dead_letters"][0]["id"], letter_ids[0].as_str());
    assert_eq!(page["next_cursor"].as_str().map(|c| c.parse::<u64>().is_ok()), Some(true), "{page}");
    let shown = ok(&app, &["dlq", "show", &letter_ids[1]]);
    assert!(shown.contains(r#"{"n":1}"#) && shown.contains("x-origin: a, b"), "{shown}");

    failing.store(false, std::sync::atomic::Ordering::SeqCst);
    let redriven = ok(&app, &["dlq", "redrive", &letter_ids[1], &letter_ids[0]]);
    let lines: Vec<&str> = redriven.lines().collect();
    assert!(lines[0].starts_with(&format!("{} redriven to K #", letter_ids[0])), "in the stream's order: {redriven}");
    let again = json_of(&app, &["dlq", "redrive", "--stream", "K", "--key", "poison"]);
    assert!(again.as_array().unwrap().iter().all(|r| r["earlier"] == true), "{again}");

    let refused = keygate(&app, &["dlq", "rm", "--force"]);
    assert_eq!(refused.status.code(), Some(1), "deleting takes ids or a filter");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("give ids"));
    assert!(ok(&app, &["dlq", "rm", "--key", "poison", "--force"]).contains("deleted 2 dead letters"));
    assert_eq!(app.get("/v1/dead-letters").await.1["dead_letters"], json!([]));
}
