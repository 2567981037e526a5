//! The browser example at /demo, end to end in headless Chromium.

use std::time::{Duration, Instant};

use crate::support::browser::Browser;
use crate::support::TestApp;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_page_joins_a_group_receives_messages_in_order_and_acks_them_by_button() {
    let app = TestApp::start().await;
    let html = app.http.get(app.url("/demo")).send().await.unwrap().text().await.unwrap();
    assert!(!html.contains("src=\"http") && !html.contains("href=\"http"), "no assets from elsewhere");

    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/demo?stream=DEMO&group=g&member=web")).await;
    browser.eval("document.getElementById('setup').click()").await;
    crate::support::eventually(Duration::from_secs(10), || async {
        (app.get("/v1/streams/DEMO/groups/g").await.0 == 200).then_some(())
    })
    .await;
    browser.eval("document.getElementById('join').click()").await;
    wait_for(&mut browser, "document.getElementById('status').textContent.startsWith('connected')").await;
    // Ten messages over five keys, published by the page itself.
    browser.eval("document.getElementById('publish10').click()").await;
    wait_for(&mut browser, "document.getElementById('status').textContent.startsWith('pinned')").await;

    // Ack by button whatever is shown; each partition shows its next message
    // only after the previous one is acked.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let acked = browser
            .eval(
                "(() => { for (const b of document.querySelectorAll('button[data-action=ack]:not(:disabled)')) b.click();
                   return document.querySelectorAll('.message.acked').length; })()",
            )
            .await;
        if acked == 10 {
            break;
        }
        assert!(Instant::now() < deadline, "only {acked} of 10 acked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Per partition, the page shows each key's messages in publish order.
    let order = browser
        .eval(
            "[...document.querySelectorAll('.message')].map(m => m.querySelector('.meta').textContent.split(' ')[1] + ':' + JSON.parse(m.querySelector('code').textContent).n)",
        )
        .await;
    let mut last: std::collections::HashMap<String, u64> = Default::default();
    for entry in order.as_array().unwrap() {
        let (key, n) = entry.as_str().unwrap().split_once(':').unwrap();
        let n: u64 = n.parse().unwrap();
        assert!(last.get(key).is_none_or(|prev| *prev < n), "{order}");
        last.insert(key.to_owned(), n);
    }
    crate::support::eventually(Duration::from_secs(10), || async {
        let info = app.js.get_stream("DEMO").await.ok()?.consumer_info("g-web").await.ok()?;
        (info.ack_floor.stream_sequence == 10 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    let artifact = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/e2e/demo.png");
    browser.screenshot(&artifact).await;
    println!("screenshot: {}", artifact.display());
}

pub(crate) async fn wait_for(browser: &mut Browser, condition: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while browser.eval(condition).await != true {
        assert!(Instant::now() < deadline, "never true: {condition}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_partitions_and_pins_and_step_down_moves_the_pin() {
    use crate::support::receiver::{Answer, Receiver};
    use serde_json::json;
    // Pins stay where the server put them: a balancing step-down of m1 before
    // the page shows its pin would leave m1 unpinned until its next message
    // (balancing has its own tests in tests/it/scale_out.rs).
    let unbalanced = |s: &mut keygate::settings::Settings| s.pin_balance_slack = 2;
    let app = TestApp::start_with(unbalanced).await;
    // A second replica: each member then has a pinned instance and a standby.
    let _replica = TestApp::start_on_with(app.nats_url.clone(), unbalanced).await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":4})).await;
    let (status, _) =
        app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":4,"members":["m1","m2"]})).await;
    assert_eq!(status, 201);
    let receiver = Receiver::start(|r, _| if r.key() == "stuck" { Answer::status(500) } else { Answer::ok() }).await;
    for member in ["m1", "m2"] {
        let hook =
            json!({"url": receiver.url("/hook"), "max_attempts": 1000, "backoff": {"initial_ms": 500, "max_ms": 1000}});
        assert_eq!(app.put(&format!("/v1/streams/ORDERS/groups/g/members/{member}/webhook"), hook).await.0, 201);
    }
    let publish = |key: String| {
        let app = &app;
        async move { assert_eq!(app.post("/v1/streams/ORDERS/messages", json!({"key": key, "data": {}})).await.0, 200) }
    };
    for n in 0..20 {
        publish(format!("k{n}")).await;
    }
    publish("stuck".into()).await;

    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/ui")).await;
    // Every partition is shown with its owner; m1's pin is shown.
    wait_for(&mut browser, "document.querySelectorAll('[data-group=g] .cell').length === 4").await;
    let pinned = "(() => { const c = document.querySelector('[data-group=g] tr[data-member=m1] .pin'); return c ? c.textContent : ''; })()";
    let deadline = Instant::now() + Duration::from_secs(20);
    let before = loop {
        let text = browser.eval(pinned).await.as_str().unwrap_or_default().to_owned();
        if !text.is_empty() && text != "standby" && text != "no instance" && text != "free, taken on the next delivery"
        {
            break text;
        }
        assert!(Instant::now() < deadline, "no pin shown for m1: {text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Both replicas' instances of m1 are listed: one pinned, one standby.
    wait_for(
        &mut browser,
        "(() => { const c = document.querySelector('[data-group=g] tr[data-member=m1] .instances'); return !!c && c.textContent.split(',').length === 2 && c.textContent.includes('★'); })()",
    )
    .await;
    // The blocked partition shows, with its attempts and last error.
    wait_for(&mut browser, "document.querySelectorAll('[data-group=g] .cell.blocked').length === 1").await;
    wait_for(&mut browser, "[...document.querySelectorAll('.blockedrow')].some(r => r.textContent.includes('500'))")
        .await;
    // Step down m1 by button: the server pins m1's next pull anew.
    browser.eval("document.querySelector('button[data-action=step-down][data-member=m1]').click()").await;
    for n in 20..40 {
        publish(format!("k{n}")).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = browser.eval(pinned).await.as_str().unwrap_or_default().to_owned();
        if !text.is_empty()
            && text != before
            && text != "standby"
            && text != "no instance"
            && text != "free, taken on the next delivery"
        {
            break;
        }
        assert!(Instant::now() < deadline, "the pin did not move: still {text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The events feed shows the pin changes.
    wait_for(&mut browser, "document.getElementById('events').textContent.includes('member.unpinned')").await;
    let artifact = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/e2e/dashboard.png");
    browser.screenshot(&artifact).await;
    println!("screenshot: {}", artifact.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_uses_the_admin_token_entered_once_and_keeps_it_for_the_tab() {
    use serde_json::json;
    let secret = "a-test-secret-of-at-least-32-bytes!!";
    let app = TestApp::start_with(|s| s.auth.hs256_secret = Some(secret.into())).await;
    let claims = json!({"scope": "keygate:admin", "exp": time::OffsetDateTime::now_utc().unix_timestamp() + 600});
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap();
    let r = app
        .http
        .put(app.url("/v1/streams/SECURE"))
        .bearer_auth(&token)
        .json(&json!({"subjects":["secure.*"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/ui")).await;
    // Without the token the page says what the API answered.
    wait_for(&mut browser, "document.getElementById('streams').textContent.includes('401')").await;
    browser
        .eval(&format!(
            "(() => {{ const t = document.getElementById('token'); t.value = '{token}'; t.dispatchEvent(new Event('change')); }})()"
        ))
        .await;
    wait_for(&mut browser, "!!document.querySelector('[data-stream=SECURE]')").await;
    // Kept for the tab: a reload needs no new entry.
    browser.navigate(&app.url("/ui")).await;
    wait_for(&mut browser, "!!document.querySelector('[data-stream=SECURE]')").await;
    assert_eq!(browser.eval("sessionStorage.getItem('keygate-token') !== null").await, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_dead_letters_tab_lists_redrives_and_deletes() {
    use crate::dead_letters::{group_with_hook, poison_receiver, publish, wait_for_letters};
    let app = TestApp::start().await;
    let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let receiver = poison_receiver(failing.clone()).await;
    group_with_hook(&app, &receiver).await;
    for n in 0..2 {
        publish(&app, "poison", n).await;
    }
    wait_for_letters(&app, 2).await;
    failing.store(false, std::sync::atomic::Ordering::SeqCst);

    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/ui")).await;
    browser.eval("document.getElementById('tab-letters').click()").await;
    wait_for(&mut browser, "document.querySelectorAll('#dl-table tr[data-letter]').length === 2").await;
    // Filtered by key: nothing for another key.
    browser
        .eval("document.getElementById('dl-key').value = 'other'; document.getElementById('dl-search').click()")
        .await;
    wait_for(&mut browser, "document.querySelectorAll('#dl-table tr[data-letter]').length === 0").await;
    browser
        .eval("document.getElementById('dl-key').value = 'poison'; document.getElementById('dl-search').click()")
        .await;
    wait_for(&mut browser, "document.querySelectorAll('#dl-table tr[data-letter]').length === 2").await;
    // Redrive the first by button: the row says where it went, and the endpoint gets it.
    browser.eval("document.querySelector('#dl-table tr[data-letter=\"1\"] button[data-action=redrive]').click()").await;
    wait_for(
        &mut browser,
        "document.querySelector('#dl-table tr[data-letter=\"1\"] .redriven').textContent.startsWith('K #')",
    )
    .await;
    crate::support::eventually(Duration::from_secs(20), || async {
        receiver.requests().iter().any(|r| r.header("keygate-redriven-from") == Some("1") && r.ok()).then_some(())
    })
    .await;
    // Delete the other by button.
    browser.eval("document.querySelector('#dl-table tr[data-letter=\"2\"] button[data-action=delete]').click()").await;
    wait_for(&mut browser, "document.querySelectorAll('#dl-table tr[data-letter]').length === 1").await;
    assert_eq!(app.get("/v1/dead-letters/2").await.0, 404);
    let artifact = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/e2e/dashboard-dead-letters.png");
    browser.screenshot(&artifact).await;
    println!("screenshot: {}", artifact.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_pauses_and_resumes_a_member() {
    use serde_json::json;
    let app = TestApp::start().await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["m1"]});
    assert_eq!(app.put("/v1/streams/ORDERS/groups/g", group).await.0, 201);
    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/ui")).await;
    wait_for(&mut browser, "!!document.querySelector('button[data-action=pause][data-member=m1]')").await;
    browser.eval("document.querySelector('button[data-action=pause][data-member=m1]').click()").await;
    wait_for(
        &mut browser,
        "(() => { const c = document.querySelector('[data-group=g] tr[data-member=m1] .pin'); return !!c && c.textContent.startsWith('paused by anonymous'); })()",
    )
    .await;
    wait_for(&mut browser, "document.getElementById('events').textContent.includes('member.paused')").await;
    assert_eq!(
        app.get("/v1/streams/ORDERS/groups/g").await.1["assignment"][0]["paused"]["reason"],
        "paused from the dashboard"
    );
    browser.eval("document.querySelector('button[data-action=resume][data-member=m1]').click()").await;
    wait_for(&mut browser, "!!document.querySelector('button[data-action=pause][data-member=m1]')").await;
    assert!(app.get("/v1/streams/ORDERS/groups/g").await.1["assignment"][0]["paused"].is_null());
}
