//! The threads that serve client connections: a current-thread runtime each, one per core by
//! default (`worker_threads`).
//!
//! A connection is served from its first byte to its last on one worker, and so is what its
//! requests start there: its socket, registered with the worker's own reactor (the accepting
//! runtime hands it over unregistered), the upstream connections its requests open (each
//! worker keeps its own pool per upstream, see [`crate::stack`]), their timers, the tasks of
//! an HTTP/2 connection's streams. A request then crosses no thread on its way: on one
//! work-stealing runtime shared by every connection, a request's client connection, upstream
//! connection and timers were woken on whichever thread polled the socket, and each crossing
//! cost a futex or eventfd wake and a context switch. What the workers share is the proxy's
//! state (the fleet, the tenants, the metrics, the limits), each behind its own lock.
//!
//! A new connection goes to the worker serving the fewest connections at the time (the next
//! in turn among equals). A connection never moves: a client that sends everything over one
//! HTTP/2 connection is served by one core, as nginx and Envoy serve it.

use std::future::Future;
use std::io;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

/// The worker threads, stopped (and joined) when dropped: what they still run is dropped
/// with them.
#[derive(Debug)]
pub struct Workers {
    workers: Box<[Worker]>,
    /// Where the next search for the least-loaded worker starts.
    next: AtomicUsize,
}

#[derive(Debug)]
struct Worker {
    handle: Handle,
    /// The connections it serves now.
    open: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Workers {
    /// Starts `n` worker threads, each with a current-thread runtime (I/O and time enabled);
    /// `0` starts one per core, as [`std::thread::available_parallelism`] tells.
    pub fn start(n: usize) -> io::Result<Workers> {
        let n = match n {
            0 => thread::available_parallelism().map_or(1, NonZeroUsize::get),
            n => n,
        };
        let mut workers = Vec::with_capacity(n);
        for i in 0..n {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = rt.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = thread::Builder::new()
                .name(format!("llm-retry-proxy-worker-{i}"))
                .spawn(move || {
                    // Runs what is spawned on it until told to stop (or the sender is gone).
                    rt.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            workers.push(Worker {
                handle,
                open: Arc::new(AtomicUsize::new(0)),
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        Ok(Workers {
            workers: workers.into(),
            next: AtomicUsize::new(0),
        })
    }

    /// How many worker threads there are.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there is none (never, once started).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The connections each worker serves now, in worker order.
    pub fn connections(&self) -> Vec<usize> {
        self.workers
            .iter()
            .map(|w| w.open.load(Ordering::Relaxed))
            .collect()
    }

    /// Runs a connection's task in `set`, on the worker serving the fewest connections, counted
    /// there until the task ends.
    pub fn spawn<F>(&self, set: &mut JoinSet<()>, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let n = self.workers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let worker = (0..n)
            .map(|k| &self.workers[(start + k) % n])
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
            .expect("at least one worker");
        worker.open.fetch_add(1, Ordering::Relaxed);
        let open = Open(worker.open.clone());
        set.spawn_on(
            async move {
                let _open = open;
                task.await;
            },
            &worker.handle,
        );
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in self.workers.iter_mut() {
            if let Some(stop) = w.stop.take() {
                let _ = stop.send(());
            }
        }
        for w in self.workers.iter_mut() {
            if let Some(thread) = w.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// One connection counted on its worker until its task ends, however it ends.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_to_the_least_loaded_worker_and_are_counted_until_they_end() {
        let workers = Workers::start(3).expect("workers");
        assert_eq!(workers.len(), 3);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut set = JoinSet::new();
            let mut release = Vec::new();
            let (names_tx, mut names) = tokio::sync::mpsc::unbounded_channel();
            for _ in 0..4 {
                let (tx, rx) = oneshot::channel::<()>();
                release.push(tx);
                let names_tx = names_tx.clone();
                workers.spawn(&mut set, async move {
                    let name = thread::current().name().map(str::to_owned);
                    let _ = names_tx.send(name);
                    let _ = rx.await;
                });
            }
            let mut seen = Vec::new();
            for _ in 0..4 {
                seen.push(names.recv().await.flatten().expect("a named thread"));
            }
            seen.sort();
            // Four connections on three workers: one of them has two, each its own thread.
            let mut counts = workers.connections();
            counts.sort_unstable();
            assert_eq!(counts, [1, 1, 2]);
            seen.dedup();
            assert_eq!(
                seen,
                [
                    "llm-retry-proxy-worker-0",
                    "llm-retry-proxy-worker-1",
                    "llm-retry-proxy-worker-2"
                ]
            );
            // Ended, a connection no longer counts; the next goes where there is fewest.
            for tx in release.drain(..2) {
                let _ = tx.send(());
            }
            for _ in 0..2 {
                set.join_next().await.expect("a task").expect("ended well");
            }
            assert_eq!(workers.connections().iter().sum::<usize>(), 2);
            let before = workers.connections();
            let (tx, rx) = oneshot::channel::<()>();
            workers.spawn(&mut set, async move {
                let _ = rx.await;
            });
            let after = workers.connections();
            let grew = (0..3).find(|&i| after[i] > before[i]).expect("one grew");
            assert_eq!(before[grew], *before.iter().min().expect("three"));
            let _ = tx.send(());
            for tx in release {
                let _ = tx.send(());
            }
            while set.join_next().await.is_some() {}
            assert_eq!(workers.connections(), [0, 0, 0]);
        });
    }

    #[test]
    fn dropped_workers_drop_what_they_still_run() {
        let workers = Workers::start(1).expect("workers");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (tx, rx) = oneshot::channel::<()>();
        rt.block_on(async {
            let mut set = JoinSet::new();
            workers.spawn(&mut set, async move {
                // Never ends by itself: `tx` is dropped only with the task.
                let _tx = tx;
                std::future::pending::<()>().await;
            });
            // Detached: the set would abort it when dropped, which is not what is tested.
            set.detach_all();
        });
        drop(workers);
        // The task was dropped with its worker's runtime, and its sender with it.
        assert!(rx.blocking_recv().is_err());
    }
}
