//! The connection the scripts of a fleet go through: one Redis node (a reconnecting
//! connection manager), or a Redis Cluster (feature `fleet-redis-cluster`), whose client sends
//! each script to the node that owns the hash slot of its first key (the scope's hash tag) and
//! follows the cluster's redirections (`MOVED`, `ASK`) while slots move.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};

use super::*;

/// A connection to the fleet's Redis: one node, or a cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Node(ConnectionManager),
    #[cfg(feature = "fleet-redis-cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            #[cfg(feature = "fleet-redis-cluster")]
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Node(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "fleet-redis-cluster")]
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c) => c.get_db(),
            #[cfg(feature = "fleet-redis-cluster")]
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// How the background tasks of a store's scopes get their one shared connection: made by the
/// first that needs it, lazily (it connects, and reconnects, in the background).
#[derive(Clone)]
pub(super) enum Connector {
    Node(redis::Client, Arc<Mutex<Option<ConnectionManager>>>),
    #[cfg(feature = "fleet-redis-cluster")]
    Cluster(
        Arc<[redis::Client]>,
        Arc<Mutex<Option<redis::cluster_async::ClusterConnection>>>,
    ),
}

impl Connector {
    /// The store's connection, made now if it is not yet; `None` when it cannot be made.
    pub(super) fn connect(&self, call_timeout: Duration) -> Option<Conn> {
        let t = call_timeout;
        match self {
            Connector::Node(client, cell) => {
                let mut cell = cell.lock().unwrap_or_else(PoisonError::into_inner);
                if cell.is_none() {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(t))
                        .set_response_timeout(Some(t))
                        .set_number_of_retries(1)
                        .set_min_delay(Duration::from_millis(50))
                        .set_max_delay(Duration::from_secs(1));
                    *cell = ConnectionManager::new_lazy_with_config(client.clone(), config).ok();
                }
                cell.clone().map(Conn::Node)
            }
            #[cfg(feature = "fleet-redis-cluster")]
            Connector::Cluster(seeds, cell) => {
                let mut cell = cell.lock().unwrap_or_else(PoisonError::into_inner);
                if cell.is_none() {
                    let nodes = seeds.iter().map(|c| c.get_connection_info().clone());
                    // A redirection is followed at once; a node that does not answer is the
                    // call's deadline's business (each call has one), not a reason to wait
                    // through a long series of retries.
                    let wait = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
                    let client = redis::cluster::ClusterClientBuilder::new(nodes)
                        .connection_timeout(t)
                        .response_timeout(t)
                        .retries(3)
                        .min_retry_wait(1)
                        .max_retry_wait(wait)
                        .build()
                        .ok()?;
                    let config = redis::cluster::ClusterConfig::new()
                        .set_connection_timeout(t)
                        .set_response_timeout(t);
                    *cell = Some(client.get_pending_async_connection_with_config(config));
                }
                cell.clone().map(Conn::Cluster)
            }
        }
    }
}

/// The node URLs of a cluster URL: `redis+cluster://[user:password@]host1:port1,host2:port2/`
/// (`rediss+cluster://` for TLS) gives `redis://[user:password@]host1:port1/`, … : the
/// credentials apply to every node. `None` when `url` is not a cluster URL; `Some(Err)` when
/// it is one, badly formed.
pub(super) fn cluster_nodes(url: &str) -> Option<Result<Vec<String>, ConfigError>> {
    let (scheme, rest) = url.split_once("://")?;
    let node_scheme = match scheme {
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        _ => return None,
    };
    // The message never quotes the URL: it may carry a password.
    let bad = |why: &str| {
        Some(Err(ConfigError::new(format!(
            "invalid Redis Cluster URL: {why}"
        ))))
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    if !(path.is_empty() || path == "0") {
        // A cluster has one database.
        return bad("a cluster has only database 0");
    }
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| format!("{node_scheme}://{userinfo}{h}/"))
        .collect();
    if nodes.is_empty() {
        return bad("no seed node");
    }
    Some(Ok(nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_names_its_seed_nodes_with_its_credentials() {
        let nodes = cluster_nodes("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001/")
            .unwrap()
            .unwrap();
        assert_eq!(
            nodes,
            ["redis://:pw@10.0.0.1:7000/", "redis://:pw@10.0.0.2:7001/"]
        );
        let nodes = cluster_nodes("rediss+cluster://u:p@a:1").unwrap().unwrap();
        assert_eq!(nodes, ["rediss://u:p@a:1/"]);
        assert!(cluster_nodes("redis://127.0.0.1:6379/").is_none());
        let e = cluster_nodes("redis+cluster://:hunter2@a:1,b:2/3")
            .unwrap()
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(cluster_nodes("redis+cluster://:hunter2@/")
            .unwrap()
            .is_err());
    }
}
