use crate::support::TestApp;

#[test]
fn committed_openapi_document_matches_the_code() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
        .expect("openapi/openapi.json is committed");
    let generated = keygate::http::openapi_json();
    assert!(
        committed == generated,
        "openapi/openapi.json is out of date: run `cargo run -- openapi --output openapi/openapi.json` and commit it"
    );
    let doc: serde_json::Value = serde_json::from_str(&generated).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    for path in [
        "/v1/streams",
        "/v1/streams/{stream}",
        "/v1/streams/{stream}/messages",
        "/v1/streams/{stream}/messages/batch",
        "/v1/streams/{stream}/groups",
        "/v1/streams/{stream}/groups/{group}",
        "/v1/streams/{stream}/groups/{group}/members",
        "/v1/streams/{stream}/groups/{group}/members/{member}",
        "/v1/streams/{stream}/groups/{group}/mappings",
        "/v1/streams/{stream}/groups/{group}/members/{member}/step-down",
        "/healthz",
        "/readyz",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} is documented");
    }
}

#[tokio::test]
async fn the_document_and_an_offline_docs_page_are_served() {
    let app = TestApp::start().await;
    let (status, served) = app.get("/openapi.json").await;
    assert_eq!(status, 200);
    let generated: serde_json::Value = serde_json::from_str(&keygate::http::openapi_json()).unwrap();
    assert_eq!(served, generated);
    let page = app.http.get(app.url("/docs/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains("swagger-ui"), "the page is Swagger UI");
    assert!(!html.contains("https://"), "no assets from a CDN");
    let js = app.http.get(app.url("/docs/swagger-ui-bundle.js")).send().await.unwrap();
    assert_eq!(js.status(), 200, "Swagger UI's script is served by keygate itself");
    let (status, _) = app.get("/docs/no-such-file.js").await;
    assert_eq!(status, 404);
}
