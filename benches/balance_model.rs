//! Pin balancing at a scale this machine cannot run as processes: 30
//! replicas × 3,000 webhook members of one group, simulated in 50 ms steps
//! with keygate's own rules (`cluster/balance.rs`: the fair share, which
//! pins step down, the tenure and the hold) and a model of the rest:
//!
//! - every replica runs an instance of every member; an instance keeps a
//!   pull waiting at the server (a 5 s ack wait: the pin holder renews it
//!   every 2.5 s, a standby every 5 s) unless it holds back: for 10 s
//!   after stepping down, or while its replica holds its share of the
//!   group's pins. One holding
//!   back for the share looks again only when its replica's ledger tells
//!   it there may be room (a pin lost there, or the count of replicas
//!   changed at the replica's last comparison) or 5 s later;
//! - a pin set free (stepped down, or its holder's replica dead for the
//!   pin TTL, 5 s) goes to a random waiting pull of a live instance, the
//!   server taking waiting pulls in arrival order and pulls arriving at
//!   random phases (every member is busy, so a free pin is taken at once);
//! - each replica compares its pins with its share every 1–2 s (jittered)
//!   and counts the replicas whose last presence renewal (every 2 s) is
//!   less than 3 s old, seeing a new one 200 ms after it starts;
//! - a joining replica's instances start over its first 3 s.
//!
//! It reports, for a cold start of 30 replicas, a 30th joining 29 balanced
//! ones, and one of 30 SIGKILLed: the time until every replica holds at
//! most its share, the pins moved beside the fewest possible, the pins
//! moved more than once, and the moves in the following 60 s (flapping).
//!
//! `cargo bench --bench balance_model` (env `KEYGATE_MODEL_SEED`, default 1).

use std::collections::BTreeMap;
use std::time::Duration;

use keygate::cluster::balance::{fair_share, to_step_down, MIN_TENURE, ROOM_RECHECK, STEP_DOWN_HOLD};
use keygate::cluster::replicas::RECENT;
use keygate::names::MemberName;
use keygate::runtime::join::{pinned_ttl, pull_expiry, standby_pull_expiry};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

const MEMBERS: usize = 3000;
const REPLICAS: usize = 30;
const STEP: Duration = Duration::from_millis(50);
const ACK_WAIT: Duration = Duration::from_secs(5);
const PRESENCE_RENEW: Duration = Duration::from_secs(2);
const SEEN_AFTER: Duration = Duration::from_millis(200);
const START_SPREAD_MS: u64 = 3000;
const SLACK: usize = 0;
/// How long after balance is reached moves are still watched for.
const QUIET_WATCH: Duration = Duration::from_secs(60);
const GIVE_UP: Duration = Duration::from_secs(600);

struct Replica {
    started: Duration,
    died: Option<Duration>,
    next_balance: Duration,
    /// The replicas its balancer counted last.
    counted: usize,
    /// Its ledger told its standbys there may be room (`PinLedger::room`).
    room_told: bool,
    pins: BTreeMap<MemberName, Instant>,
}

#[derive(Clone, Default)]
struct Instance {
    started: Duration,
    hold_until: Duration,
    pull_alive_until: Duration,
    /// Holding back, it looks again then (or when told).
    next_look: Duration,
}

struct Model {
    rng: StdRng,
    /// Simulated time.
    now: Duration,
    /// The clock the balance rules read (`origin + now`).
    origin: Instant,
    names: Vec<MemberName>,
    replicas: Vec<Replica>,
    /// `[replica][member]`.
    instances: Vec<Vec<Instance>>,
    /// Which replica holds each member's pin, and since when it is free.
    holder: Vec<Option<usize>>,
    freed_at: Vec<Option<Duration>>,
    moves: Vec<u32>,
    step_downs: u64,
}

/// What one scenario measured.
struct Outcome {
    balanced_after: Option<Duration>,
    step_downs: u64,
    fewest: usize,
    moved_twice: usize,
    later_moves: u64,
    spread: (usize, usize),
}

impl Model {
    fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            now: Duration::ZERO,
            origin: Instant::now(),
            names: (0..MEMBERS).map(|m| MemberName::parse(&format!("m{m}")).unwrap()).collect(),
            replicas: Vec::new(),
            instances: Vec::new(),
            holder: vec![None; MEMBERS],
            freed_at: vec![Some(Duration::ZERO); MEMBERS],
            moves: vec![0; MEMBERS],
            step_downs: 0,
        }
    }

    fn clock(&self) -> Instant {
        self.origin + self.now
    }

    fn start_replica(&mut self) {
        let started = self.now;
        let next_balance = started + Duration::from_millis(self.rng.random_range(1000..2000));
        self.replicas.push(Replica {
            started,
            died: None,
            next_balance,
            counted: 1,
            room_told: false,
            pins: BTreeMap::new(),
        });
        let r = self.replicas.len() - 1;
        self.replicas[r].counted = self.replicas_seen_by(r);
        let instances = (0..MEMBERS)
            .map(|_| Instance {
                started: started + Duration::from_millis(self.rng.random_range(0..START_SPREAD_MS)),
                ..Instance::default()
            })
            .collect();
        self.instances.push(instances);
    }

    fn alive(&self, r: usize) -> bool {
        self.replicas[r].died.is_none()
    }

    fn live(&self) -> Vec<usize> {
        (0..self.replicas.len()).filter(|r| self.alive(*r)).collect()
    }

    /// Replicas `r` counts: started at least `SEEN_AFTER` ago (or itself),
    /// and whose last presence renewal is less than `RECENT` old
    /// (`Replicas::count`).
    fn replicas_seen_by(&self, r: usize) -> usize {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(other, replica)| {
                let last_renewal = replica.died.map(|died| {
                    let lived = (died - replica.started).as_nanos() % PRESENCE_RENEW.as_nanos();
                    died - Duration::from_nanos(lived as u64)
                });
                (*other == r || self.now >= replica.started + SEEN_AFTER)
                    && last_renewal.is_none_or(|renewed| self.now < renewed + RECENT)
            })
            .count()
    }

    /// Whether `r` holds its share of the pins (`PinLedger::has_share`)
    /// counting `replicas`.
    fn has_share(&self, r: usize, replicas: usize) -> bool {
        self.replicas[r].pins.len() >= fair_share(MEMBERS, replicas, SLACK)
    }

    fn step(&mut self) {
        self.now += STEP;
        let now = self.now;
        // Pulls: renewed unless holding back; one holding back sleeps until
        // its hold ends, its replica's ledger tells it, or it looks again.
        for r in self.live() {
            let full = self.has_share(r, self.replicas_seen_by(r));
            let told = std::mem::take(&mut self.replicas[r].room_told);
            for m in 0..MEMBERS {
                let pinned_here = self.holder[m] == Some(r);
                let instance = &mut self.instances[r][m];
                let pulling = instance.pull_alive_until > now;
                if now < instance.started || (!pulling && !told && now < instance.next_look) {
                    continue;
                }
                if now < instance.hold_until {
                    instance.next_look = instance.hold_until;
                } else if !pinned_here && full {
                    instance.next_look = now + ROOM_RECHECK;
                } else if pinned_here {
                    instance.pull_alive_until = now + pull_expiry(ACK_WAIT);
                } else {
                    instance.pull_alive_until = now + standby_pull_expiry(ACK_WAIT);
                }
            }
        }
        // A dead replica's pins lapse after the pin TTL.
        for m in 0..MEMBERS {
            if let Some(r) = self.holder[m] {
                if self.replicas[r].died.is_some_and(|died| now >= died + pinned_ttl(ACK_WAIT)) {
                    self.free(m);
                }
            }
        }
        // Free pins go to a random waiting pull.
        for m in 0..MEMBERS {
            if self.holder[m].is_some() {
                continue;
            }
            let waiting: Vec<usize> = (0..self.replicas.len())
                .filter(|r| self.alive(*r) && self.instances[*r][m].pull_alive_until > now)
                .collect();
            if waiting.is_empty() {
                continue;
            }
            let r = waiting[self.rng.random_range(0..waiting.len())];
            self.holder[m] = Some(r);
            let since = self.clock();
            self.replicas[r].pins.insert(self.names[m].clone(), since);
            if self.freed_at[m].take().is_some_and(|at| at > Duration::ZERO) {
                self.moves[m] += 1;
            }
        }
        // Each replica's balancer.
        for r in self.live() {
            if now < self.replicas[r].next_balance {
                continue;
            }
            self.replicas[r].next_balance = now + Duration::from_millis(self.rng.random_range(1000..2000));
            let counted = self.replicas_seen_by(r);
            if counted != self.replicas[r].counted {
                self.replicas[r].counted = counted;
                self.replicas[r].room_told = true;
            }
            let share = fair_share(MEMBERS, counted, SLACK);
            for member in to_step_down(&self.replicas[r].pins, share, self.clock(), MIN_TENURE) {
                let m: usize = member.as_str()[1..].parse().unwrap();
                self.free(m);
                // Its pulls carried the old pin id (the server refuses them) and it holds back.
                let instance = &mut self.instances[r][m];
                instance.pull_alive_until = now;
                instance.hold_until = now + STEP_DOWN_HOLD;
                self.step_downs += 1;
            }
        }
    }

    fn free(&mut self, m: usize) {
        if let Some(r) = self.holder[m].take() {
            self.replicas[r].pins.remove(&self.names[m]);
            self.replicas[r].room_told = true;
            self.freed_at[m] = Some(self.now);
        }
    }

    /// Fewest and most pins on a live replica.
    fn spread(&self) -> (usize, usize) {
        let counts: Vec<usize> = self.live().into_iter().map(|r| self.replicas[r].pins.len()).collect();
        (counts.iter().copied().min().unwrap_or(0), counts.iter().copied().max().unwrap_or(0))
    }

    fn balanced(&self) -> bool {
        let share = fair_share(MEMBERS, self.live().len(), SLACK);
        self.holder.iter().all(|h| h.is_some_and(|r| self.alive(r))) && self.spread().1 <= share
    }

    /// Runs until balanced (then `QUIET_WATCH` longer), measuring from now.
    fn settle(&mut self, fewest: usize) -> Outcome {
        let from = self.now;
        let step_downs = self.step_downs;
        self.moves.iter_mut().for_each(|m| *m = 0);
        let mut balanced_after = None;
        while self.now - from < GIVE_UP {
            self.step();
            if self.balanced() {
                balanced_after = Some(self.now - from);
                break;
            }
        }
        let moved_until_balanced = self.step_downs - step_downs;
        let moved_twice = self.moves.iter().filter(|m| **m > 1).count();
        let quiet_from = self.step_downs;
        let until = self.now + QUIET_WATCH;
        while self.now < until {
            self.step();
        }
        Outcome {
            balanced_after,
            step_downs: moved_until_balanced,
            fewest,
            moved_twice,
            later_moves: self.step_downs - quiet_from,
            spread: self.spread(),
        }
    }
}

fn print(scenario: &str, o: &Outcome) {
    let time = o.balanced_after.map_or_else(|| "not within 600 s".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()));
    let step_downs = if o.fewest == 0 {
        o.step_downs.to_string()
    } else {
        format!("{} ({:.2}× the fewest)", o.step_downs, o.step_downs as f64 / o.fewest as f64)
    };
    println!(
        "| {scenario} | {} | {time} | {step_downs} | {} | {} | {}–{} |",
        o.fewest, o.moved_twice, o.later_moves, o.spread.0, o.spread.1
    );
}

fn main() {
    let seed: u64 = std::env::var("KEYGATE_MODEL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    println!("keygate pin-balancing model: {REPLICAS} replicas, {MEMBERS} webhook members of one group, seed {seed}");
    println!("| scenario | fewest moves possible | balanced after | pins stepped down | pins moved twice or more | moves in the next 60 s | pins per replica after |");
    println!("|---|---|---|---|---|---|---|");

    // Cold start: every replica starts at once; pins land where pulls come first.
    let mut model = Model::new(seed);
    for _ in 0..REPLICAS {
        model.start_replica();
    }
    let fewest = 0;
    let cold = model.settle(fewest);
    print(&format!("cold start of {REPLICAS} replicas"), &cold);

    // A replica joins 29 balanced ones.
    let mut model = Model::new(seed);
    for _ in 0..REPLICAS - 1 {
        model.start_replica();
    }
    model.settle(0);
    model.start_replica();
    let joined = model.settle(MEMBERS / REPLICAS);
    print(&format!("a replica joins {} balanced ones", REPLICAS - 1), &joined);

    // One of 30 is SIGKILLed: its pins lapse and land on the survivors.
    let victim = 0;
    model.replicas[victim].died = Some(model.now);
    let fewest = 0;
    let killed = model.settle(fewest);
    print(&format!("one of {REPLICAS} SIGKILLed"), &killed);
}
