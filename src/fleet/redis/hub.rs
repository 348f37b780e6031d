//! The one pub/sub subscription of a store: every scope of a process that shares a
//! [`RedisFleet`] (the tenants of a per-scope fleet, the fleets built from one store) learns
//! the closings of its gate on one connection, each message routed by its channel, which
//! names the scope's hash. A subscription per scope would be a connection per scope.
//!
//! On a Redis Cluster the closings are published with `PUBLISH`, which the cluster delivers
//! to the subscribers of every node, so the one subscription is made on any node: the first
//! seed node that answers, the next when it is lost. Sharded pub/sub (`SSUBSCRIBE`) would
//! keep a message on its slot's node, but needs a subscription on every node that owns a
//! scope of the process, moved along with every slot that moves; closings are rare (one per
//! scope and `Retry-After` at most, as the gate only ever extends), so the broadcast costs
//! the cluster little, and one connection per process keeps what one node has.

use std::collections::{HashMap, HashSet};
use std::sync::Weak;

use super::*;

/// The subscription a store's scopes share, and the scopes it routes to.
#[derive(Default)]
pub(super) struct Hub {
    state: Mutex<HubState>,
    /// A scope came or went: the task subscribes, unsubscribes, or ends.
    changed: Notify,
}

#[derive(Default)]
struct HubState {
    /// The scopes listening, by channel (two fleets of one process may share a scope).
    scopes: HashMap<String, Vec<Weak<Shared>>>,
    /// The task runs: the next scope to come is subscribed by it, not by a new one.
    running: bool,
}

impl Hub {
    /// `shared` listens on its scope's channel; the task is started (on `handle`, subscribing
    /// on one of `nodes`) unless it runs.
    pub(super) fn join(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        nodes: Arc<[redis::Client]>,
        handle: &tokio::runtime::Handle,
    ) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .scopes
            .entry(shared.keys.channel.clone())
            .or_default()
            .push(Arc::downgrade(shared));
        if state.running {
            drop(state);
            self.changed.notify_one();
        } else {
            state.running = true;
            handle.spawn(listen(self.clone(), nodes, shared.call_timeout));
        }
    }

    /// A scope's fleet was dropped: its channel may go, and the task with the last.
    pub(super) fn leave(&self) {
        self.changed.notify_one();
    }

    /// The channels of the scopes still listening; `None` (and the task marked ended) when
    /// none is left.
    fn channels(&self) -> Option<HashSet<String>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.scopes.retain(|_, scopes| {
            scopes.retain(|s| s.upgrade().is_some_and(|s| !s.cancel.is_cancelled()));
            !scopes.is_empty()
        });
        if state.scopes.is_empty() {
            state.running = false;
            return None;
        }
        Some(state.scopes.keys().cloned().collect())
    }

    fn route(&self, msg: &redis::Msg) {
        let scopes: Vec<Arc<Shared>> = {
            let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match state.scopes.get(msg.get_channel_name()) {
                Some(scopes) => scopes.iter().filter_map(Weak::upgrade).collect(),
                None => return,
            }
        };
        for shared in scopes {
            on_message(&shared, msg);
        }
    }
}

/// The hub's task: subscribes the scopes' channels on one connection, routes the messages,
/// connects again when the connection goes (to the next of `nodes`, a cluster's seed nodes;
/// a closing missed meanwhile is made up for by each scope's poll), and ends with the last
/// scope.
async fn listen(hub: Arc<Hub>, nodes: Arc<[redis::Client]>, call_timeout: Duration) {
    let mut running = Running(Some(hub.clone()));
    let mut subscribed: HashSet<String> = HashSet::new();
    let mut node = 0;
    // The nodes tried in a row without a subscription.
    let mut missed = 0;
    loop {
        let Some(wanted) = hub.channels() else {
            running.0 = None;
            return;
        };
        let client = &nodes[node % nodes.len()];
        let connect = tokio::time::timeout(call_timeout * 4, client.get_async_pubsub()).await;
        let Ok(Ok(pubsub)) = connect else {
            node += 1;
            missed += 1;
            if missed >= nodes.len() {
                // None now: again after a pause, or when a scope comes or goes.
                missed = 0;
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    () = hub.changed.notified() => {}
                }
            }
            continue;
        };
        missed = 0;
        let (mut sink, mut stream) = pubsub.split();
        subscribed.clear();
        if resubscribe(&mut sink, &mut subscribed, wanted, call_timeout)
            .await
            .is_err()
        {
            continue;
        }
        loop {
            tokio::select! {
                msg = stream.next() => match msg {
                    Some(msg) => hub.route(&msg),
                    // The connection went (its node with it, maybe): connect again, to the
                    // next node first.
                    None => {
                        node += 1;
                        break;
                    }
                },
                () = hub.changed.notified() => {
                    let Some(wanted) = hub.channels() else {
                        running.0 = None;
                        return;
                    };
                    if resubscribe(&mut sink, &mut subscribed, wanted, call_timeout)
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    }
}

/// Marks the task ended when it ends other than by finding no scope left (which marks it
/// under the same lock as it looks): its runtime shut down. The next scope to come starts
/// another.
struct Running(Option<Arc<Hub>>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(hub) = &self.0 {
            hub.state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .running = false;
        }
    }
}

/// Subscribes the channels wanted and not yet subscribed, unsubscribes those no longer.
async fn resubscribe(
    sink: &mut redis::aio::PubSubSink,
    subscribed: &mut HashSet<String>,
    wanted: HashSet<String>,
    call_timeout: Duration,
) -> Result<(), ()> {
    let new: Vec<&String> = wanted.difference(subscribed).collect();
    let gone: Vec<&String> = subscribed.difference(&wanted).collect();
    let calls = async {
        if !new.is_empty() {
            sink.subscribe(&new).await?;
        }
        if !gone.is_empty() {
            sink.unsubscribe(&gone).await?;
        }
        Ok::<_, redis::RedisError>(())
    };
    match tokio::time::timeout(call_timeout * 4, calls).await {
        Ok(Ok(())) => {
            *subscribed = wanted;
            Ok(())
        }
        _ => Err(()),
    }
}
