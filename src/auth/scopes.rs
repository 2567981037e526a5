//! Pure scope logic: what a request needs, and whether a token's scopes
//! grant it. A granted scope ending in `*` grants every scope that starts
//! with what comes before the `*` (`publish:*`, `consume:orders/*`).

/// The scope that grants everything.
pub const ADMIN: &str = "keygate:admin";

/// What one request needs from its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// Anyone, no token.
    Open,
    /// `keygate:admin`: streams, groups, webhooks, step-down, partition operations.
    Admin,
    /// `publish:<stream>`.
    Publish { stream: String },
    /// `consume:<stream>/<group>`; a missing stream or group means "all of them".
    Consume { stream: Option<String>, group: Option<String> },
    /// `subscribe:<stream>/<consumer>`: a plain consumer's subscriber. A
    /// separate verb, so a grant for group `billing` never reaches a plain
    /// consumer that happens to share its name.
    Subscribe { stream: String, consumer: String },
    /// Any `consume:` or `subscribe:` grant (or admin): routes whose
    /// handler then checks each object's own scope (dead letters).
    SomeConsumption,
}

impl Requirement {
    /// The scope a token must carry (or cover with a wildcard); `None` when open.
    pub fn scope(&self) -> Option<String> {
        match self {
            Self::Open => None,
            Self::Admin => Some(ADMIN.to_owned()),
            Self::Publish { stream } => Some(format!("publish:{stream}")),
            Self::Consume { stream: None, .. } => Some("consume:*".to_owned()),
            Self::Consume { stream: Some(stream), group: None } => Some(format!("consume:{stream}/*")),
            Self::Consume { stream: Some(stream), group: Some(group) } => Some(format!("consume:{stream}/{group}")),
            Self::Subscribe { stream, consumer } => Some(format!("subscribe:{stream}/{consumer}")),
            Self::SomeConsumption => Some("consume:<stream>/<group> or subscribe:<stream>/<consumer>".to_owned()),
        }
    }
}

/// The scopes one verified token carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scopes(Vec<String>);

impl Scopes {
    /// Scopes from the `scope` claim (space-separated) and the `scopes` claim (an array), merged.
    pub fn from_claims(scope: Option<&str>, scopes: Option<&[String]>) -> Self {
        let mut all: Vec<String> = scope.unwrap_or_default().split_whitespace().map(str::to_owned).collect();
        all.extend(scopes.unwrap_or_default().iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()));
        all.sort();
        all.dedup();
        Self(all)
    }

    /// The scopes, sorted.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    /// Whether these scopes grant `requirement`. `keygate:admin` grants everything.
    pub fn allows(&self, requirement: &Requirement) -> bool {
        if *requirement == Requirement::SomeConsumption {
            return self.0.iter().any(|granted| {
                covers(granted, ADMIN) || ["consume:", "subscribe:"].iter().any(|verb| grants_some_of(granted, verb))
            });
        }
        let Some(needed) = requirement.scope() else { return true };
        self.0.iter().any(|granted| covers(granted, ADMIN) || covers(granted, &needed))
    }
}

/// Whether `granted` covers `needed`. A `needed` ending in `*` ("every
/// group of this stream") is covered only by a grant at least as wide.
fn covers(granted: &str, needed: &str) -> bool {
    match granted.strip_suffix('*') {
        Some(prefix) => needed.starts_with(prefix),
        None => granted == needed,
    }
}

/// Whether `granted` grants anything of the scopes starting with `verb`.
fn grants_some_of(granted: &str, verb: &str) -> bool {
    match granted.strip_suffix('*') {
        Some(prefix) => verb.starts_with(prefix) || prefix.starts_with(verb),
        None => granted.starts_with(verb) && granted.len() > verb.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scopes(list: &str) -> Scopes {
        Scopes::from_claims(Some(list), None)
    }

    fn publish(stream: &str) -> Requirement {
        Requirement::Publish { stream: stream.into() }
    }

    fn consume(stream: Option<&str>, group: Option<&str>) -> Requirement {
        Requirement::Consume { stream: stream.map(Into::into), group: group.map(Into::into) }
    }

    #[test]
    fn scope_and_scopes_claims_merge() {
        let merged = Scopes::from_claims(Some("publish:a  consume:a/g"), Some(&["keygate:admin".into(), "".into()]));
        assert_eq!(merged.as_slice(), ["consume:a/g", "keygate:admin", "publish:a"]);
    }

    #[test]
    fn group_and_plain_consumer_grants_are_distinct() {
        let group = scopes("consume:S/billing");
        let plain = Requirement::Subscribe { stream: "S".into(), consumer: "billing".into() };
        assert!(!group.allows(&plain), "a group grant does not reach a plain consumer of the same name");
        assert!(!scopes("consume:*").allows(&plain));
        assert!(scopes("subscribe:S/billing").allows(&plain));
        assert!(scopes("subscribe:S/*").allows(&plain));
        assert!(!scopes("subscribe:S/billing").allows(&consume(Some("S"), Some("billing"))));
    }

    #[test]
    fn some_consumption_is_any_consume_or_subscribe_grant() {
        let some = Requirement::SomeConsumption;
        for granted in ["consume:S/g", "subscribe:S/c", "consume:S/*", "consume:*", "c*", "*", "keygate:admin"] {
            assert!(scopes(granted).allows(&some), "{granted}");
        }
        for granted in ["publish:*", "publish:S", "consume:", "consumer:x", "p*"] {
            assert!(!scopes(granted).allows(&some), "{granted}");
        }
    }

    #[test]
    fn open_needs_nothing() {
        assert!(Scopes::default().allows(&Requirement::Open));
        assert!(!Scopes::default().allows(&Requirement::Admin));
    }

    #[test]
    fn admin_grants_everything() {
        let admin = scopes("keygate:admin");
        for requirement in [Requirement::Admin, publish("orders"), consume(None, None), consume(Some("o"), Some("g"))] {
            assert!(admin.allows(&requirement), "{requirement:?}");
        }
    }

    #[test]
    fn publish_is_per_stream_with_trailing_wildcards() {
        assert!(scopes("publish:orders").allows(&publish("orders")));
        assert!(!scopes("publish:orders").allows(&publish("orders2")));
        assert!(!scopes("publish:orders").allows(&Requirement::Admin));
        assert!(scopes("publish:*").allows(&publish("anything")));
        assert!(scopes("publish:ord*").allows(&publish("orders2")));
        assert!(!scopes("publish:*").allows(&consume(Some("orders"), Some("g"))));
        assert!(!scopes("publish:*").allows(&Requirement::Admin));
    }

    #[test]
    fn consume_is_per_stream_and_group() {
        let one = scopes("consume:orders/billing");
        assert!(one.allows(&consume(Some("orders"), Some("billing"))));
        assert!(!one.allows(&consume(Some("orders"), Some("shipping"))));
        assert!(!one.allows(&consume(Some("orders"), None)), "one group does not grant every group");
        assert!(!one.allows(&consume(None, None)));
        assert!(!one.allows(&publish("orders")));
        let stream = scopes("consume:orders/*");
        assert!(stream.allows(&consume(Some("orders"), Some("shipping"))));
        assert!(stream.allows(&consume(Some("orders"), None)));
        assert!(!stream.allows(&consume(Some("orders2"), Some("g"))));
        assert!(!stream.allows(&consume(None, None)));
        let all = scopes("consume:*");
        assert!(all.allows(&consume(None, None)));
        assert!(all.allows(&consume(Some("x"), Some("y"))));
    }

    #[test]
    fn a_bare_star_and_keygate_star_grant_everything() {
        assert!(scopes("*").allows(&Requirement::Admin));
        assert!(scopes("keygate:*").allows(&Requirement::Admin));
        assert!(scopes("keygate:*").allows(&publish("s")));
    }

    #[test]
    fn a_star_inside_a_scope_is_literal() {
        assert!(!scopes("publish:*s").allows(&publish("orders")));
        assert!(!scopes("consume:*/billing").allows(&consume(Some("orders"), Some("billing"))));
    }
}
