//! Where webhooks may go. keygate is a sidecar: by default it calls its
//! neighbour on loopback and hosts the operator listed; private networks
//! and the public internet need an explicit allowance. Checked when a
//! webhook is registered and again on every connection (a DNS answer can
//! change after registration).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// Which destinations webhooks may reach.
#[derive(Debug, Clone, Default)]
pub struct DestinationPolicy {
    /// Host names (exact, case-insensitive) always allowed, whatever they resolve to.
    pub allowed_hosts: Vec<String>,
    /// Allow private, link-local and unique-local addresses.
    pub allow_private: bool,
    /// Allow public internet addresses.
    pub allow_public: bool,
    /// The only directory webhook credential files (`bearer_file`, `mtls`)
    /// are read from; `None`: no credential files.
    pub credentials_dir: Option<std::path::PathBuf>,
}

/// What kind of address a destination is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressClass {
    Loopback,
    Private,
    Public,
    /// Unspecified, multicast, broadcast, documentation: never a webhook.
    Unusable,
}

/// Classifies an IP address.
pub fn classify(ip: IpAddr) -> AddressClass {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return classify_v4(v4);
            }
            let seg = v6.segments();
            let embedded_v4 = |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
            if v6.is_loopback() {
                AddressClass::Loopback
            } else if v6.is_unspecified() || v6.is_multicast() || seg[0] == 0x2001 && seg[1] == 0x0db8 {
                AddressClass::Unusable
            } else if seg[..6] == [0, 0, 0, 0, 0, 0] {
                // IPv4-compatible ::a.b.c.d
                classify_v4(embedded_v4(seg[6], seg[7]))
            } else if seg[0] == 0x0064 && seg[1] == 0xff9b {
                // NAT64 64:ff9b::/96 (and the local-use /48) reach the embedded IPv4 address.
                classify_v4(embedded_v4(seg[6], seg[7]))
            } else if seg[0] == 0x2002 {
                // 6to4 2002:a.b.c.d::/48
                classify_v4(embedded_v4(seg[1], seg[2]))
            } else if seg[0] & 0xfe00 == 0xfc00 || seg[0] & 0xffc0 == 0xfe80 || seg[0] & 0xffc0 == 0xfec0 {
                AddressClass::Private
            } else {
                AddressClass::Public
            }
        }
    }
}

fn classify_v4(ip: Ipv4Addr) -> AddressClass {
    let [a, b, c, _] = ip.octets();
    if ip.is_loopback() {
        AddressClass::Loopback
    } else if ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || a >= 240
    {
        AddressClass::Unusable
    } else if ip.is_private()
        || ip.is_link_local()
        || (a == 100 && (64..128).contains(&b))
        || (a == 198 && (b == 18 || b == 19))
        || (a == 192 && b == 0 && c == 0)
    {
        AddressClass::Private
    } else {
        AddressClass::Public
    }
}

impl DestinationPolicy {
    /// Whether `host` is on the operator's list.
    pub fn host_listed(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.allowed_hosts.iter().any(|h| h.eq_ignore_ascii_case(host))
    }

    /// Why `ip` may not be called, if it may not.
    pub fn refuse_address(&self, ip: IpAddr) -> Option<String> {
        match classify(ip) {
            AddressClass::Loopback => None,
            AddressClass::Private if self.allow_private => None,
            AddressClass::Public if self.allow_public => None,
            AddressClass::Private => Some(format!(
                "{ip} is a private-network address; allow it with --webhook-allow-private or list the host in --webhook-allowed-hosts"
            )),
            AddressClass::Public => Some(format!(
                "{ip} is a public address; allow it with --webhook-allow-public or list the host in --webhook-allowed-hosts"
            )),
            AddressClass::Unusable => Some(format!("{ip} cannot be a webhook destination")),
        }
    }

    /// Checks a webhook URL: scheme, host, and every address it resolves to.
    pub async fn check_url(&self, url: &str) -> Result<reqwest::Url, DestinationError> {
        if let Some(suggestion) = with_scheme(url) {
            return Err(DestinationError::NoScheme { suggestion });
        }
        let parsed =
            reqwest::Url::parse(url).map_err(|source| DestinationError::InvalidUrl { url: url.to_owned(), source })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(DestinationError::Scheme(parsed.scheme().to_owned()));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(DestinationError::Credentials);
        }
        let host = parsed.host_str().ok_or_else(|| DestinationError::NoHost(url.to_owned()))?.to_owned();
        if self.host_listed(&host) {
            return Ok(parsed);
        }
        let port = parsed.port_or_known_default().unwrap_or(80);
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addresses: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((bare, port))
                .await
                .map_err(|source| DestinationError::Unresolvable { host: host.clone(), source })?
                .collect(),
        };
        if addresses.is_empty() {
            return Err(DestinationError::NoAddress(host));
        }
        for address in &addresses {
            if let Some(why) = self.refuse_address(address.ip()) {
                return Err(DestinationError::NotAllowed { host, why });
            }
        }
        Ok(parsed)
    }
}

/// Why a webhook URL may not be called.
#[derive(Debug, thiserror::Error)]
pub enum DestinationError {
    #[error("{url:?} is not a valid URL: {source}")]
    InvalidUrl { url: String, source: <reqwest::Url as std::str::FromStr>::Err },
    #[error("webhook URLs must be http or https, not {0}")]
    Scheme(String),
    #[error("the webhook URL has no scheme: did you mean {suggestion:?}?")]
    NoScheme { suggestion: String },
    #[error("webhook URLs must not carry credentials; use the signing secret")]
    Credentials,
    #[error("{0:?} has no host")]
    NoHost(String),
    #[error("cannot resolve {host}: {source}")]
    Unresolvable { host: String, source: std::io::Error },
    #[error("{0} resolves to no address")]
    NoAddress(String),
    /// The policy refuses one of the addresses the host resolves to.
    #[error("destination {host} not allowed: {why}")]
    NotAllowed { host: String, why: String },
}

/// The URL with `http://` in front when it was written without a scheme
/// (`127.0.0.1:9000/orders`, `localhost:9000/orders`): what comes before
/// the first `:` is then a host and what follows a port, not a scheme.
fn with_scheme(url: &str) -> Option<String> {
    if url.contains("://") {
        return None;
    }
    let (host, rest) = url.split_once(':')?;
    let port_follows = rest.split('/').next().is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let host_like = !host.is_empty() && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    (host_like && port_follows).then(|| format!("http://{url}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    #[test]
    fn a_url_written_without_its_scheme_gets_http_suggested() {
        assert_eq!(with_scheme("127.0.0.1:9000/orders").as_deref(), Some("http://127.0.0.1:9000/orders"));
        assert_eq!(with_scheme("localhost:9000").as_deref(), Some("http://localhost:9000"));
        assert_eq!(with_scheme("http://127.0.0.1:9000/orders"), None);
        assert_eq!(with_scheme("mailto:someone@example.com"), None, "a scheme, just not http");
        assert_eq!(with_scheme("ftp:21"), Some("http://ftp:21".into()), "host:port reads as a host");
    }

    #[test]
    fn addresses_are_classified() {
        let c = |s: &str| classify(s.parse().unwrap());
        assert_eq!(c("127.0.0.1"), AddressClass::Loopback);
        assert_eq!(c("::1"), AddressClass::Loopback);
        assert_eq!(c("10.1.2.3"), AddressClass::Private);
        assert_eq!(c("172.16.0.1"), AddressClass::Private);
        assert_eq!(c("192.168.1.1"), AddressClass::Private);
        assert_eq!(c("169.254.169.254"), AddressClass::Private);
        assert_eq!(c("100.64.0.1"), AddressClass::Private);
        assert_eq!(c("fd00::1"), AddressClass::Private);
        assert_eq!(c("fe80::1"), AddressClass::Private);
        assert_eq!(c("::ffff:10.0.0.1"), AddressClass::Private);
        assert_eq!(c("8.8.8.8"), AddressClass::Public);
        assert_eq!(c("2606:4700::1111"), AddressClass::Public);
        assert_eq!(c("0.0.0.0"), AddressClass::Unusable);
        assert_eq!(c("224.0.0.1"), AddressClass::Unusable);
        assert_eq!(classify(IpAddr::V6(Ipv6Addr::UNSPECIFIED)), AddressClass::Unusable);
        assert_eq!(c("64:ff9b::a9fe:a9fe"), AddressClass::Private, "NAT64 of 169.254.169.254");
        assert_eq!(c("2002:a00:1::1"), AddressClass::Private, "6to4 of 10.0.0.1");
        assert_eq!(c("::10.0.0.1"), AddressClass::Private, "IPv4-compatible");
        assert_eq!(c("::127.0.0.1"), AddressClass::Loopback);
        assert_eq!(c("fec0::1"), AddressClass::Private, "site-local");
        assert_eq!(c("192.0.0.192"), AddressClass::Private);
        assert_eq!(c("240.0.0.1"), AddressClass::Unusable);
    }

    #[tokio::test]
    async fn the_default_policy_allows_loopback_only() {
        let policy = DestinationPolicy::default();
        assert!(policy.check_url("http://127.0.0.1:9000/hook").await.is_ok());
        assert!(policy.check_url("http://localhost:9000/hook").await.is_ok());
        let refused = policy.check_url("http://169.254.169.254/latest/meta-data").await.unwrap_err();
        assert!(
            matches!(&refused, DestinationError::NotAllowed { host, .. } if host == "169.254.169.254"),
            "{refused}"
        );
        assert!(refused.to_string().contains("private-network"), "{refused}");
        assert!(policy.check_url("http://8.8.8.8/").await.unwrap_err().to_string().contains("public"));
        assert!(policy.check_url("ftp://127.0.0.1/").await.is_err());
        assert!(policy.check_url("http://user:pw@127.0.0.1/").await.is_err());
        let open = DestinationPolicy { allow_private: true, ..Default::default() };
        assert!(open.check_url("http://10.0.0.5/hook").await.is_ok());
        let listed = DestinationPolicy { allowed_hosts: vec!["10.9.9.9".into()], ..Default::default() };
        assert!(listed.check_url("http://10.9.9.9/hook").await.is_ok());
    }
}
