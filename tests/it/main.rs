//! Integration tests: keygate against a real nats-server.

mod auth;
mod batch_delivery;
mod chaos;
mod cli;
mod cloudevents;
mod cluster;
mod consumers;
mod cors;
mod dead_letters;
mod delivery;
mod demo;
mod errors;
mod failover;
mod groups;
mod hardening;
mod js_client;
mod key_order;
mod node_loss;
mod openapi;
mod outbound_auth;
mod pauses;
mod pipeline_stages;
mod pipelines;
mod protection;
mod publish;
mod pull;
mod scale_out;
mod seek;
mod serve;
mod streams;
mod telemetry;
mod websocket;

use keygate_testkit as support;
