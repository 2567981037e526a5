use serde_json::json;

use crate::support::TestApp;

#[tokio::test]
async fn put_creates_then_confirms_then_refuses_a_changed_partition_count() {
    let app = TestApp::start().await;
    let spec = json!({"subjects":["orders.*"],"partitions":10});
    let (status, view) = app.put("/v1/streams/ORDERS", spec.clone()).await;
    assert_eq!(status, 201);
    assert_eq!(view["partitions"], 10);
    assert_eq!(view["key_wildcards"], json!([1]));
    assert_eq!(view["subject_transform"], "orders.* -> {{partition(10,1)}}.orders.{{wildcard(1)}}");

    let (status, _) = app.put("/v1/streams/ORDERS", spec).await;
    assert_eq!(status, 200);

    let (status, problem) = app.put("/v1/streams/ORDERS", json!({"subjects":["orders.*"],"partitions":8})).await;
    assert_eq!(status, 409);
    assert!(problem["detail"].as_str().unwrap().contains("partition count never changes"));

    // The server holds exactly the transform keygate reported.
    let info = app.js.get_stream("ORDERS").await.unwrap().cached_info().clone();
    let transform = info.config.subject_transform.unwrap();
    assert_eq!(transform.source, "orders.*");
    assert_eq!(transform.destination, "{{partition(10,1)}}.orders.{{wildcard(1)}}");
}

#[tokio::test]
async fn get_list_and_delete_streams() {
    let app = TestApp::start().await;
    app.create_stream("A", json!({"subjects":["a.*"],"partitions":3})).await;
    app.create_stream("B", json!({"subjects":["b.>"]})).await;
    let (status, list) = app.get("/v1/streams").await;
    assert_eq!(status, 200);
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["A", "B"]);
    let (_, b) = app.get("/v1/streams/B").await;
    assert_eq!(b["partitions"], serde_json::Value::Null);
    assert_eq!(b["messages"], 0);

    let (status, _) = app.delete("/v1/streams/A").await;
    assert_eq!(status, 204);
    let (status, _) = app.get("/v1/streams/A").await;
    assert_eq!(status, 404);
    let (status, _) = app.delete("/v1/streams/A").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn multi_wildcard_streams_stamp_the_chosen_wildcards_in_order() {
    let app = TestApp::start().await;
    let (status, view) =
        app.put("/v1/streams/VM", json!({"subjects":["vm.*.*"],"partitions":7,"key_wildcards":[2,1]})).await;
    assert_eq!(status, 201);
    assert_eq!(view["subject_transform"], "vm.*.* -> {{partition(7,2,1)}}.vm.{{wildcard(1)}}.{{wildcard(2)}}");
}

#[tokio::test]
async fn invalid_stream_specs_change_nothing() {
    let app = TestApp::start().await;
    for bad in [
        json!({"subjects":["a.*","b.*"],"partitions":2}),
        json!({"subjects":["a.*"],"partitions":0}),
        json!({"subjects":["a.*"],"partitions":2,"key_wildcards":[3]}),
        json!({"subjects":[]}),
        json!({"subjects":["a..b"]}),
        json!({"subjects":["a.*"],"bogus":1}),
    ] {
        let (status, _) = app.put("/v1/streams/S", bad.clone()).await;
        assert_eq!(status, 400, "{bad}");
    }
    let (status, _) = app.put("/v1/streams/bad.name", json!({"subjects":["x"]})).await;
    assert_eq!(status, 400);
    let (_, list) = app.get("/v1/streams").await;
    assert_eq!(list, json!([]));
}

#[tokio::test]
async fn overlapping_subjects_are_a_conflict() {
    let app = TestApp::start().await;
    app.create_stream("ONE", json!({"subjects":["x.*"]})).await;
    let (status, _) = app.put("/v1/streams/TWO", json!({"subjects":["x.*"]})).await;
    assert_eq!(status, 409);
}

#[tokio::test]
async fn an_identical_put_with_explicit_defaults_is_unchanged() {
    let app = TestApp::start().await;
    let spec = json!({"subjects":["z.*"],"partitions":2,"max_msgs":0,"max_bytes":0,"duplicate_window_ms":0,"description":"","storage":"file","replicas":1,"max_age_ms":0});
    let (status, _) = app.put("/v1/streams/Z", spec.clone()).await;
    assert_eq!(status, 201);
    let (status, body) = app.put("/v1/streams/Z", spec).await;
    assert_eq!(status, 200, "{body}");
}
