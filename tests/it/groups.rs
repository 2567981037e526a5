use std::time::Duration;

use async_nats::jetstream::{consumer, stream};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::support::{eventually, TestApp};
use keygate::partition::{encode_key, partition_of_tokens};

async fn stamped_stream(app: &TestApp, partitions: u32) {
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":partitions})).await;
}

#[tokio::test]
async fn static_groups_are_stored_exactly_as_pcgroups_writes_them() {
    let app = TestApp::start().await;
    stamped_stream(&app, 10).await;
    let (status, view) = app
        .put(
            "/v1/streams/ORDERS/groups/fulfil",
            json!({"kind":"static","partitions":10,"members":["m2","m10","m1"],"filters":["orders.*"]}),
        )
        .await;
    assert_eq!(status, 201, "{view}");
    let raw = app.kv_raw("static-consumer-groups", "ORDERS.fulfil").await.unwrap();
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        r#"{"max_members":10,"filters":["orders.*"],"members":["m2","m10","m1"]}"#
    );
    // Byte-wise sort: m1 < m10 < m2 (docs/pcgroups-compatibility.md's worked example).
    let owned: Vec<(String, Value)> = view["assignment"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["member"].as_str().unwrap().to_owned(), m["partitions"].clone()))
        .collect();
    assert_eq!(
        owned,
        vec![("m1".into(), json!([0, 1, 2, 9])), ("m10".into(), json!([3, 4, 5])), ("m2".into(), json!([6, 7, 8]))]
    );
    assert_eq!(view["assignment"][0]["consumer"], "fulfil-m1");

    let (status, _) = app
        .put("/v1/streams/ORDERS/groups/mapped", json!({"kind":"static","partitions":10,"mappings":[{"member":"a","partitions":[9,0,1,2,3]},{"member":"b","partitions":[4,5,6,7,8]}]}))
        .await;
    assert_eq!(status, 201);
    let raw = app.kv_raw("static-consumer-groups", "ORDERS.mapped").await.unwrap();
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        r#"{"max_members":10,"member_mappings":[{"member":"a","partitions":[9,0,1,2,3]},{"member":"b","partitions":[4,5,6,7,8]}]}"#
    );
    let bucket = app.js.get_key_value("static-consumer-groups").await.unwrap();
    let status = bucket.status().await.unwrap();
    assert_eq!(status.history(), 1);

    // Identical PUT: 200; membership change on a static group: 409.
    let (status, _) = app
        .put(
            "/v1/streams/ORDERS/groups/fulfil",
            json!({"kind":"static","partitions":10,"members":["m2","m10","m1"],"filters":["orders.*"]}),
        )
        .await;
    assert_eq!(status, 200);
    let (status, _) = app
        .put(
            "/v1/streams/ORDERS/groups/fulfil",
            json!({"kind":"static","partitions":10,"members":["m1"],"filters":["orders.*"]}),
        )
        .await;
    assert_eq!(status, 409);
    let (_, list) = app.get("/v1/streams/ORDERS/groups").await;
    assert_eq!(list, json!([{"group":"fulfil","kind":"static"},{"group":"mapped","kind":"static"}]));
}

#[tokio::test]
async fn elastic_groups_source_a_work_queue_that_stamps_keygates_partitions() {
    let app = TestApp::start().await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    let (status, view) = app
        .put(
            "/v1/streams/EV/groups/billing",
            json!({"kind":"elastic","partitions":4,"partitioning_filters":[{"filter":"ev.*","wildcards":[1]}],"members":["a","b"],"max_buffered_msgs":1000}),
        )
        .await;
    assert_eq!(status, 201, "{view}");
    let raw = app.kv_raw("elastic-consumer-groups", "EV.billing").await.unwrap();
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        r#"{"max_members":4,"partitioning_filters":[{"filter":"ev.*","partitioning_wildcards":[1]}],"max_buffered_msg":1000,"members":["a","b"]}"#
    );
    let wq = app.js.get_stream("EV-billing").await.unwrap().cached_info().clone();
    assert_eq!(wq.config.retention, stream::RetentionPolicy::WorkQueue);
    assert_eq!(wq.config.discard, stream::DiscardPolicy::New);
    assert!(wq.config.allow_direct);
    assert_eq!(wq.config.max_messages, 1000);
    let source = &wq.config.sources.as_ref().unwrap()[0];
    assert_eq!(source.name, "EV");
    assert_eq!(source.subject_transforms[0].source, "ev.*");
    assert_eq!(source.subject_transforms[0].destination, "{{Partition(4,1)}}.ev.{{Wildcard(1)}}");

    let keys: Vec<String> = (0..200).map(|i| format!("user {i}")).collect();
    let messages: Vec<Value> = keys.iter().map(|k| json!({"key": k})).collect();
    let (status, _) = app.post("/v1/streams/EV/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200);
    let mut expected = [0u64; 4];
    for key in &keys {
        expected[partition_of_tokens([encode_key(key).unwrap().as_str()], 4) as usize] += 1;
    }
    let view = eventually(Duration::from_secs(10), || async {
        let (_, view) = app.get("/v1/streams/EV/groups/billing").await;
        let total: u64 = view["partition_pending"].as_array()?.iter().map(|p| p["pending"].as_u64().unwrap()).sum();
        (total == 200).then_some(view)
    })
    .await;
    let pending: Vec<u64> =
        view["partition_pending"].as_array().unwrap().iter().map(|p| p["pending"].as_u64().unwrap()).collect();
    assert_eq!(pending, expected.to_vec(), "the server stamped the partitions keygate computes");
    assert_eq!(view["partition_pending"][0]["member"], "a");
    assert_eq!(view["partition_pending"][3]["member"], "b");
}

#[tokio::test]
async fn a_go_written_config_with_null_filters_is_served_and_kept_null() {
    let app = TestApp::start().await;
    app.create_stream("GO", json!({"subjects":["go.>"]})).await;
    // Exactly what Go's CreateElastic writes with nil partitioning filters.
    let kv = app
        .js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: "elastic-consumer-groups".into(),
            history: 1,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    kv.put("GO.workers", Bytes::from_static(br#"{"max_members":4,"partitioning_filters":null,"members":["w2","w1"]}"#))
        .await
        .unwrap();
    app.js
        .create_stream(stream::Config {
            name: "GO-workers".into(),
            retention: stream::RetentionPolicy::WorkQueue,
            discard: stream::DiscardPolicy::New,
            allow_direct: true,
            sources: Some(vec![stream::Source {
                name: "GO".into(),
                subject_transforms: vec![stream::SubjectTransform {
                    source: ">".into(),
                    destination: "{{Partition(4)}}.>".into(),
                }],
                ..Default::default()
            }]),
            ..Default::default()
        })
        .await
        .unwrap();

    let (status, view) = app.get("/v1/streams/GO/groups/workers").await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["kind"], "elastic");
    assert_eq!(view["partitioning_filters"], Value::Null);
    assert_eq!(view["config"]["partitioning_filters"], Value::Null);

    // keygate's identical create is accepted (null compares equal to omitted).
    let (status, _) = app.put("/v1/streams/GO/groups/workers", json!({"kind":"elastic","partitions":4})).await;
    assert_eq!(status, 200);
    // But [] is not null: Go would see a changed config.
    let (status, _) = app
        .put("/v1/streams/GO/groups/workers", json!({"kind":"elastic","partitions":4,"partitioning_filters":[]}))
        .await;
    assert_eq!(status, 409);

    let (status, membership) = app.post("/v1/streams/GO/groups/workers/members", json!({"members":["w3"]})).await;
    assert_eq!(status, 200);
    assert_eq!(membership["members"], json!(["w2", "w1", "w3"]));
    let raw = String::from_utf8(app.kv_raw("elastic-consumer-groups", "GO.workers").await.unwrap()).unwrap();
    assert_eq!(raw, r#"{"max_members":4,"partitioning_filters":null,"members":["w2","w1","w3"]}"#);

    let (status, _) = app.delete("/v1/streams/GO/groups/workers/members/w2").await;
    assert_eq!(status, 200);
    let raw = String::from_utf8(app.kv_raw("elastic-consumer-groups", "GO.workers").await.unwrap()).unwrap();
    assert_eq!(raw, r#"{"max_members":4,"partitioning_filters":null,"members":["w1","w3"]}"#);

    // keygate keeps fields a newer writer added.
    kv.put(
        "GO.future",
        Bytes::from_static(br#"{"max_members":2,"partitioning_filters":null,"members":["a"],"new_field":{"x":1}}"#),
    )
    .await
    .unwrap();
    let (status, _) = app.post("/v1/streams/GO/groups/future/members", json!({"members":["b"]})).await;
    assert_eq!(status, 200);
    let raw = String::from_utf8(app.kv_raw("elastic-consumer-groups", "GO.future").await.unwrap()).unwrap();
    assert_eq!(raw, r#"{"max_members":2,"partitioning_filters":null,"members":["a","b"],"new_field":{"x":1}}"#);
}

#[tokio::test]
async fn concurrent_membership_edits_all_land_through_compare_and_set() {
    let app = TestApp::start().await;
    app.create_stream("C", json!({"subjects":["c.*"]})).await;
    let (status, _) =
        app.put("/v1/streams/C/groups/g", json!({"kind":"elastic","partitions":32,"members":["m00"]})).await;
    assert_eq!(status, 201);
    let adds = (1..12).map(|i| {
        let app = &app;
        async move { app.post("/v1/streams/C/groups/g/members", json!({"members":[format!("m{i:02}")]})).await }
    });
    for (status, body) in futures::future::join_all(adds).await {
        assert_eq!(status, 200, "{body}");
    }
    let (_, view) = app.get("/v1/streams/C/groups/g").await;
    let mut members: Vec<String> =
        view["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_owned()).collect();
    members.sort();
    assert_eq!(members, (0..12).map(|i| format!("m{i:02}")).collect::<Vec<_>>());
    assert_eq!(view["revision"].as_u64().unwrap(), 12, "one revision per edit");
}

#[tokio::test]
async fn mappings_replace_members_and_block_member_edits() {
    let app = TestApp::start().await;
    app.create_stream("M", json!({"subjects":["m.*"]})).await;
    app.put("/v1/streams/M/groups/g", json!({"kind":"elastic","partitions":3,"members":["a"]})).await;
    let (status, _) =
        app.put("/v1/streams/M/groups/g/mappings", json!({"mappings":[{"member":"x","partitions":[0,1]}]})).await;
    assert_eq!(status, 400);
    let (status, body) = app
        .put(
            "/v1/streams/M/groups/g/mappings",
            json!({"mappings":[{"member":"x","partitions":[2,0]},{"member":"y","partitions":[1]}]}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["members"], json!([]));
    assert_eq!(body["ownership"], json!([{"member":"x","partitions":[2,0]},{"member":"y","partitions":[1]}]));
    let note = body["note"].as_str().unwrap();
    assert!(note.starts_with("mappings replace the group's member list"), "{note}");
    assert!(note.ends_with("no longer in the member list: a"), "the replaced members are named: {note}");
    let raw = String::from_utf8(app.kv_raw("elastic-consumer-groups", "M.g").await.unwrap()).unwrap();
    assert_eq!(
        raw,
        r#"{"max_members":3,"partitioning_filters":null,"member_mappings":[{"member":"x","partitions":[2,0]},{"member":"y","partitions":[1]}]}"#
    );
    let (status, _) = app.post("/v1/streams/M/groups/g/members", json!({"members":["z"]})).await;
    assert_eq!(status, 409);
    let (status, _) = app.delete("/v1/streams/M/groups/g/members/x").await;
    assert_eq!(status, 409);
    // Deleting the mappings with nobody to take over would leave every
    // partition without an owner: refused, changing nothing.
    let (status, body) = app.delete("/v1/streams/M/groups/g/mappings").await;
    assert_eq!(status, 409, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("no members") && detail.contains("?members=m1,m2"), "{detail}");
    let (_, view) = app.get("/v1/streams/M/groups/g").await;
    assert_eq!(view["mappings"], json!([{"member":"x","partitions":[2,0]},{"member":"y","partitions":[1]}]), "{view}");
    let (status, body) = app.delete("/v1/streams/M/groups/g/mappings?members=bad.name").await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = app.delete("/v1/streams/M/groups/g/mappings?members=x,z,x").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["mappings"], Value::Null);
    assert_eq!(body["members"], json!(["x", "z"]));
    let owners: Vec<&str> =
        body["ownership"].as_array().unwrap().iter().map(|o| o["member"].as_str().unwrap()).collect();
    assert_eq!(owners.len(), 2, "both members own partitions: {body}");
    let (status, _) = app.post("/v1/streams/M/groups/g/members", json!({"members":["w"]})).await;
    assert_eq!(status, 200);
    // Without mappings there is nothing to delete (a retried call finds its
    // own edit done): answered as it stands, whatever members are named.
    for path in ["/v1/streams/M/groups/g/mappings", "/v1/streams/M/groups/g/mappings?members=x,z"] {
        let (status, body) = app.delete(path).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["members"], json!(["x", "z", "w"]));
    }
}

#[tokio::test]
async fn invalid_groups_are_refused_and_change_nothing() {
    let app = TestApp::start().await;
    stamped_stream(&app, 4).await;
    app.create_stream("PLAIN", json!({"subjects":["plain.*"]})).await;
    let cases = [
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"static","partitions":4,"members":["a"],"mappings":[{"member":"a","partitions":[0,1,2,3]}]}),
            400,
        ),
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"static","partitions":4,"mappings":[{"member":"a","partitions":[0,1]}]}),
            400,
        ),
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"static","partitions":4,"mappings":[{"member":"a","partitions":[0,1,2,4]}]}),
            400,
        ),
        ("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":0}), 400),
        ("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":4,"members":["bad.name"]}), 400),
        ("/v1/streams/ORDERS/groups/g", json!({"kind":"sideways","partitions":4}), 400),
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"elastic","partitions":4,"partitioning_filters":[{"filter":"orders.x"}]}),
            400,
        ),
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"elastic","partitions":4,"partitioning_filters":[{"filter":"orders.*","wildcards":[2]}]}),
            400,
        ),
        ("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":6}), 422),
        ("/v1/streams/PLAIN/groups/g", json!({"kind":"static","partitions":4}), 422),
        ("/v1/streams/NOPE/groups/g", json!({"kind":"elastic","partitions":4}), 404),
        ("/v1/streams/ORDERS/groups/bad.group", json!({"kind":"static","partitions":4}), 400),
        // The stamped stream stores `<p>.orders.<key>`: `orders.*` would match nothing.
        (
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"elastic","partitions":4,"partitioning_filters":[{"filter":"orders.*","wildcards":[1]}]}),
            422,
        ),
    ];
    for (path, body, want) in cases {
        let (status, problem) = app.put(path, body.clone()).await;
        assert_eq!(status, want, "{body}: {problem}");
    }
    let (_, list) = app.get("/v1/streams/ORDERS/groups").await;
    assert_eq!(list, json!([]));
    assert!(app.js.get_key_value("static-consumer-groups").await.is_err(), "no bucket was created");
    assert!(app.js.get_key_value("elastic-consumer-groups").await.is_err(), "no bucket was created");

    // A name used by one flavour cannot be created as the other.
    let (status, _) = app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":4})).await;
    assert_eq!(status, 201);
    let (status, _) = app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"elastic","partitions":4})).await;
    assert_eq!(status, 409);
    let (status, _) = app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":8})).await;
    assert_eq!(status, 409);
    assert!(app.js.get_stream("ORDERS-g").await.is_err(), "no work-queue stream was made");
    let (status, _) = app.get("/v1/streams/ORDERS/groups/unknown").await;
    assert_eq!(status, 404);
}

/// Creates member `m`'s consumer exactly as Go's pcgroups does and pulls
/// one message with the pinned-client protocol.
async fn join_like_pcgroups(app: &TestApp, group: &str, member: &str, filters: Vec<String>) -> async_nats::Message {
    app.js
        .get_stream("ORDERS")
        .await
        .unwrap()
        .create_consumer(consumer::pull::Config {
            durable_name: Some(format!("{group}-{member}")),
            filter_subjects: filters,
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(5),
            priority_groups: vec!["PCG".into()],
            priority_policy: consumer::PriorityPolicy::PinnedClient,
            priority_timeout: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .unwrap();
    // JetStream answers a pull on the inbox with the message's own subject,
    // so the reply is read from a plain subscription, not `request`.
    let inbox = app.nats.new_inbox();
    let mut replies = app.nats.subscribe(inbox.clone()).await.unwrap();
    app.nats
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.ORDERS.{group}-{member}"),
            inbox,
            Bytes::from_static(br#"{"batch":1,"expires":2000000000,"group":"PCG"}"#),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), replies.next()).await.unwrap().unwrap()
}

#[tokio::test]
async fn group_view_shows_pin_holders_backlog_and_step_down_unpins() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":2,"members":["m1","m2"]})).await;
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let messages: Vec<Value> = keys.iter().map(|k| json!({"key": k})).collect();
    let (_, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": messages})).await;
    let on_p0 = acks["results"].as_array().unwrap().iter().filter(|r| r["partition"] == 0).count() as u64;

    let stored = app.get("/v1/streams/ORDERS/groups/g").await.1;
    let filters: Vec<String> = vec!["0.>".into()];
    assert_eq!(stored["partition_pending"][0]["pending"], on_p0);

    let message = join_like_pcgroups(&app, "g", "m1", filters).await;
    let pin = message.headers.as_ref().unwrap().get("Nats-Pin-Id").unwrap().as_str().to_owned();
    assert_eq!(pin.len(), 22);
    app.nats.publish(message.reply.clone().unwrap(), Bytes::from_static(b"+ACK")).await.unwrap();
    app.nats.flush().await.unwrap();

    let view = eventually(Duration::from_secs(5), || async {
        let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
        (view["partition_pending"][0]["pending"] == on_p0 - 1).then_some(view)
    })
    .await;
    let m1 = &view["assignment"][0];
    assert_eq!(m1["member"], "m1");
    assert_eq!(m1["consumer_exists"], true);
    assert_eq!(m1["pinned_client_id"], pin.as_str());
    assert_eq!(m1["pin"], "held_elsewhere", "a client no keygate reports holds it");
    assert!(m1["pinned_since"].is_string());
    assert_eq!(view["assignment"][1]["consumer_exists"], false);

    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/members/m1/step-down", json!({})).await;
    assert_eq!(status, 204);
    let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(view["assignment"][0]["pinned_client_id"], Value::Null);
    assert_eq!(view["assignment"][0]["pin"], "no_instance", "nothing pulls for m1 now");
    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/members/m2/step-down", json!({})).await;
    assert_eq!(status, 404, "m2 has no consumer");
    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/members/zz/step-down", json!({})).await;
    assert_eq!(status, 404);
}

/// The view reads its members' consumers from the stream's consumer list,
/// a page of 256 at a time: with the group's consumers on a later page, and
/// with more consumers on the stream than the view lists (512), it tells
/// the same.
#[tokio::test]
async fn the_group_view_finds_its_consumers_among_many_others_on_the_stream() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":2,"members":["m1","m2"]})).await;
    let keys: Vec<Value> = (0..20).map(|i| json!({"key": format!("k{i}")})).collect();
    let (_, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": keys})).await;
    let on_p0 = acks["results"].as_array().unwrap().iter().filter(|r| r["partition"] == 0).count() as u64;
    let message = join_like_pcgroups(&app, "g", "m1", vec!["0.>".into()]).await;
    let pin = message.headers.as_ref().unwrap().get("Nats-Pin-Id").unwrap().as_str().to_owned();
    let orders = app.js.get_stream("ORDERS").await.unwrap();
    // Named to sort before the group's `g-…`, so its consumers are listed last.
    let add_others = async |from: usize, to: usize| {
        let creates = (from..to).map(|i| {
            let orders = orders.clone();
            async move {
                let config = consumer::pull::Config { durable_name: Some(format!("a{i:04}")), ..Default::default() };
                orders.create_consumer(config).await.unwrap();
            }
        });
        futures::future::join_all(creates).await;
    };
    let expect_members = async |others: usize| {
        let (status, view) = app.get("/v1/streams/ORDERS/groups/g").await;
        assert_eq!(status, 200, "{view}");
        let (m1, m2) = (&view["assignment"][0], &view["assignment"][1]);
        assert_eq!(
            (m1["member"].as_str(), m1["consumer_exists"].as_bool()),
            (Some("m1"), Some(true)),
            "{others} others"
        );
        assert_eq!(m1["pinned_client_id"], pin.as_str(), "{others} others");
        assert_eq!(m1["num_ack_pending"], 1, "{others} others");
        assert_eq!(m1["num_pending"], on_p0 - 1, "{others} others");
        assert_eq!(m2["consumer_exists"], false, "{others} others: m2 never joined");
        assert_eq!(view["partition_pending"][0]["pending"], on_p0, "{others} others");
    };
    expect_members(0).await;
    add_others(0, 300).await;
    expect_members(300).await;
    add_others(300, 700).await;
    expect_members(700).await;
}

/// Group reads keep their bucket open: a bucket deleted since is a group
/// not found, not an error, and one made again is read.
#[tokio::test]
async fn a_group_bucket_deleted_and_made_again_is_read_afresh() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    let group = json!({"kind":"static","partitions":2,"members":["m1"]});
    app.put("/v1/streams/ORDERS/groups/g", group.clone()).await;
    assert_eq!(app.get("/v1/streams/ORDERS/groups/g").await.0, 200);
    app.js.delete_key_value("static-consumer-groups").await.unwrap();
    let (status, problem) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 404, "{problem}");
    let (status, _) = app.put("/v1/streams/ORDERS/groups/g", group).await;
    assert_eq!(status, 201);
    assert_eq!(app.get("/v1/streams/ORDERS/groups/g").await.0, 200);
}

#[tokio::test]
async fn deleting_a_static_group_removes_only_its_members_consumers() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":2,"members":["m1"]})).await;
    app.put("/v1/streams/ORDERS/groups/g-x", json!({"kind":"static","partitions":2,"members":["m1"]})).await;
    join_like_pcgroups(&app, "g", "m1", vec!["0.>".into(), "1.>".into()]).await;
    join_like_pcgroups(&app, "g-x", "m1", vec!["0.>".into(), "1.>".into()]).await;
    let (status, _) = app.delete("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 204);
    let handle = app.js.get_stream("ORDERS").await.unwrap();
    assert!(handle.consumer_info("g-m1").await.is_err());
    assert!(handle.consumer_info("g-x-m1").await.is_ok(), "pcgroups' prefix delete would remove this one");
    assert!(app.kv_raw("static-consumer-groups", "ORDERS.g").await.is_none());
    let (status, _) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn deleting_an_elastic_group_removes_its_work_queue_stream() {
    let app = TestApp::start().await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    app.put("/v1/streams/EV/groups/g", json!({"kind":"elastic","partitions":2,"members":["a"],"ack_wait_ms":9000}))
        .await;
    let (_, view) = app.get("/v1/streams/EV/groups/g").await;
    assert_eq!(view["ack_wait_ms"], 9000);
    let (status, _) = app.delete("/v1/streams/EV/groups/g").await;
    assert_eq!(status, 204);
    assert!(app.js.get_stream("EV-g").await.is_err());
    let (status, _) = app.delete("/v1/streams/EV/groups/g").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_purged_config_key_means_the_group_is_gone() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":2,"members":["a"]})).await;
    let kv = app.js.get_key_value("static-consumer-groups").await.unwrap();
    kv.purge("ORDERS.g").await.unwrap();
    let (status, _) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn static_consumer_names_that_would_collide_are_refused() {
    let app = TestApp::start().await;
    stamped_stream(&app, 2).await;
    let (status, _) =
        app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":2,"members":["x-m1"]})).await;
    assert_eq!(status, 201);
    // `g-x` + `m1` is consumer `g-x-m1`, which `g` + `x-m1` already uses.
    let (status, problem) =
        app.put("/v1/streams/ORDERS/groups/g-x", json!({"kind":"static","partitions":2,"members":["m1"]})).await;
    assert_eq!(status, 409, "{problem}");
    assert!(app.kv_raw("static-consumer-groups", "ORDERS.g-x").await.is_none());
}

#[tokio::test]
async fn an_elastic_group_over_a_stamped_stream_partitions_the_stamped_subjects() {
    let app = TestApp::start().await;
    stamped_stream(&app, 4).await;
    let (status, view) = app
        .put(
            "/v1/streams/ORDERS/groups/e",
            json!({"kind":"elastic","partitions":2,"partitioning_filters":[{"filter":"*.orders.*","wildcards":[2]}],"members":["a"]}),
        )
        .await;
    assert_eq!(status, 201, "{view}");
    let (_, acks) =
        app.post("/v1/streams/ORDERS/messages/batch", json!({"messages":[{"key":"a"},{"key":"b"},{"key":"c"}]})).await;
    assert!(acks["results"].as_array().unwrap().iter().all(|r| r["seq"].is_u64()));
    eventually(Duration::from_secs(10), || async {
        let (_, view) = app.get("/v1/streams/ORDERS/groups/e").await;
        let total: u64 = view["partition_pending"].as_array()?.iter().filter_map(|p| p["pending"].as_u64()).sum();
        (total == 3).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_stream_with_groups_is_only_deleted_with_cascade() {
    let app = TestApp::start().await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    app.put("/v1/streams/EV/groups/g", json!({"kind":"elastic","partitions":2,"members":["a"]})).await;
    let (status, problem) = app.delete("/v1/streams/EV").await;
    assert_eq!(status, 409);
    assert!(problem["detail"].as_str().unwrap().contains("g (elastic)"), "{problem}");
    assert!(app.js.get_stream("EV").await.is_ok(), "nothing was deleted");
    let (status, _) = app.delete("/v1/streams/EV?cascade=true").await;
    assert_eq!(status, 204);
    assert!(app.js.get_stream("EV").await.is_err());
    assert!(app.js.get_stream("EV-g").await.is_err(), "the group's work-queue stream went too");
    assert!(app.kv_raw("elastic-consumer-groups", "EV.g").await.is_none());
}

/// Listing groups reads the configuration buckets without a consumer per
/// request (src/nats/kv_scan.rs): each listing through `keys()` left an
/// ephemeral consumer on keygate's own bucket for 30 s, so fast listings
/// made the server refuse new consumers and lists answer 500.
#[tokio::test]
async fn listing_groups_thousands_of_times_leaves_no_consumer_and_lists_past_a_thousand_groups() {
    let app = TestApp::start().await;
    stamped_stream(&app, 4).await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    let (status, _) = app.put("/v1/streams/ORDERS/groups/fulfil", json!({"kind":"static","partitions":4})).await;
    assert_eq!(status, 201);
    let elastic = json!({"kind":"elastic","partitions":4,"partitioning_filters":[{"filter":"ev.*","wildcards":[1]}]});
    let (status, _) = app.put("/v1/streams/EV/groups/billing", elastic).await;
    assert_eq!(status, 201);

    // Over the 1,024 subjects one batched direct get may match, some deleted
    // or purged since (their markers are no group), written as pcgroups does.
    app.create_stream("MANY", json!({"subjects":["many.*"],"partitions":4})).await;
    let statics = app.js.get_key_value("static-consumer-groups").await.unwrap();
    for i in 0..1_100 {
        statics.put(format!("MANY.g{i:04}"), r#"{"max_members":4,"members":["m"]}"#.into()).await.unwrap();
    }
    statics.delete("MANY.g0007").await.unwrap();
    statics.purge("MANY.g1099").await.unwrap();
    let (status, many) = app.get("/v1/streams/MANY/groups").await;
    assert_eq!(status, 200, "{many}");
    let many: Vec<&str> = many.as_array().unwrap().iter().map(|g| g["group"].as_str().unwrap()).collect();
    let expected: Vec<String> = (0..1_099).filter(|i| *i != 7).map(|i| format!("g{i:04}")).collect();
    assert_eq!(many, expected, "every live key, sorted, none of the deleted or purged");

    let consumers = async |bucket: &str| {
        let mut stream = app.js.get_stream(format!("KV_{bucket}")).await.unwrap();
        stream.info().await.unwrap().state.consumer_count
    };
    // keygate's one configuration watch per bucket (src/runtime/config_watch.rs), nothing else.
    let watches = (1, 1);
    eventually(Duration::from_secs(10), || async {
        let now = (consumers("static-consumer-groups").await, consumers("elastic-consumer-groups").await);
        (now == watches).then_some(())
    })
    .await;
    let app = &app;
    let lists = futures::stream::iter(0..2_000)
        .map(|i| app.get(if i % 2 == 0 { "/v1/streams/ORDERS/groups" } else { "/v1/streams/EV/groups" }))
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await;
    for (status, list) in &lists {
        assert_eq!(*status, 200, "{list}");
        let one = list.as_array().unwrap();
        assert_eq!(one.len(), 1, "{list}");
    }
    let after = (consumers("static-consumer-groups").await, consumers("elastic-consumer-groups").await);
    assert_eq!(after, watches, "no listing left a consumer on the configuration buckets");

    let (status, _) = app.put("/v1/streams/ORDERS/groups/ship", json!({"kind":"static","partitions":4})).await;
    assert_eq!(status, 201);
    let (_, list) = app.get("/v1/streams/ORDERS/groups").await;
    assert_eq!(list, json!([{"group":"fulfil","kind":"static"},{"group":"ship","kind":"static"}]));
    let (_, list) = app.get("/v1/streams/EV/groups").await;
    assert_eq!(list, json!([{"group":"billing","kind":"elastic"}]));
}

/// A pin stepped down stays free until the next message, and the view says
/// so rather than showing the member as simply unpinned; the next message
/// pins an instance again.
#[tokio::test]
async fn a_stepped_down_pin_shows_as_free_until_the_next_delivery() {
    use crate::support::receiver::{Answer, Receiver};
    let app = TestApp::start().await;
    stamped_stream(&app, 1).await;
    app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":1,"members":["m1"]})).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/m1")});
    assert_eq!(app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", hook).await.0, 201);
    let pin_of = async || app.get("/v1/streams/ORDERS/groups/g").await.1["assignment"][0]["pin"].clone();
    app.post("/v1/streams/ORDERS/messages", json!({"key":"a"})).await;
    eventually(Duration::from_secs(15), || async { (pin_of().await == "held").then_some(()) }).await;
    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/members/m1/step-down", json!({})).await;
    assert_eq!(status, 204);
    eventually(Duration::from_secs(10), || async { (pin_of().await == "free_until_next_delivery").then_some(()) })
        .await;
    app.post("/v1/streams/ORDERS/messages", json!({"key":"b"})).await;
    eventually(Duration::from_secs(15), || async { (pin_of().await == "held").then_some(()) }).await;
    eventually(Duration::from_secs(15), || async {
        (receiver.requests().iter().filter(|r| r.ok()).count() == 2).then_some(())
    })
    .await;
}
