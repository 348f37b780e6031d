//! Unit tests of `fleet::limit`.

use super::*;

/// Pacing from the first attempt, with no burst: what these tests were written for.
fn eager() -> PacingConfig {
    PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
}
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Wake;

thread_local! {
    /// Run once by the next `on_limit` between its check of the last limit and its lock.
    static BEFORE_LIMIT_LOCK: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

pub(super) fn before_limit_lock() {
    if let Some(f) = BEFORE_LIMIT_LOCK.with(|h| h.borrow_mut().take()) {
        f();
    }
}

#[test]
fn validation() {
    assert!(eager().rates(0.0, 0.0, 1.0).is_err());
    assert!(eager().rates(5.0, 6.0, 10.0).is_err());
    assert!(eager().rates(11.0, 1.0, 10.0).is_err());
    assert!(eager().rates(f64::NAN, 1.0, 10.0).is_err());
    assert!(eager().decrease(1.0).is_err());
    assert!(eager().decrease(0.0).is_err());
    assert!(eager().growth(0.0).is_err());
    assert!(eager().growth(2.0).is_err());
}

/// A waker that counts how often it was woken.
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Arc<Count>, Waker) {
    let count = Arc::new(Count(AtomicUsize::new(0)));
    (count.clone(), Waker::from(count))
}

fn woken(c: &Count) -> usize {
    c.0.load(Ordering::SeqCst)
}

fn fixed(rate: f64) -> Pacer {
    Pacer::new(eager().rates(rate, 1.0, rate).unwrap())
}

#[tokio::test(start_paused = true)]
async fn only_the_head_waits_on_the_clock_and_the_next_is_woken_when_it_goes() {
    let p = fixed(10.0);
    let t0 = Instant::now();
    let tickets: Vec<_> = (0..4).map(|_| p.ticket()).collect();
    let wakers: Vec<_> = (0..4).map(|_| counting()).collect();
    assert_eq!(p.poll_turn(tickets[0], &wakers[0].1), Turn::Go(0));
    // Behind the head: queued, to be woken (its only instant is a check on the head).
    assert!(matches!(
        p.poll_turn(tickets[2], &wakers[2].1),
        Turn::Queued { .. }
    ));
    // The head waits for its instant, 1 / rate after the last turn.
    assert_eq!(
        p.poll_turn(tickets[1], &wakers[1].1),
        Turn::Wait(t0 + Duration::from_millis(100))
    );
    tokio::time::advance(Duration::from_millis(100)).await;
    assert!(matches!(
        p.poll_turn(tickets[2], &wakers[2].1),
        Turn::Queued { .. }
    ));
    assert_eq!(woken(&wakers[2].0), 0);
    assert_eq!(p.poll_turn(tickets[1], &wakers[1].1), Turn::Go(0));
    // Ticket 2 is now the head and was told so, once.
    assert_eq!(woken(&wakers[2].0), 1);
    assert!(matches!(
        p.poll_turn(tickets[3], &wakers[3].1),
        Turn::Queued { .. }
    ));
    // Ticket 2 leaves the line before its turn: ticket 3 is the head, and is woken.
    p.abandon(tickets[2]);
    assert_eq!(woken(&wakers[3].0), 1);
    assert_eq!(
        p.poll_turn(tickets[3], &wakers[3].1),
        Turn::Wait(t0 + Duration::from_millis(200))
    );
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(p.poll_turn(tickets[3], &wakers[3].1), Turn::Go(0));
}

#[tokio::test(start_paused = true)]
async fn turns_keep_their_schedule_when_taken_a_little_late() {
    let p = fixed(300.0);
    let t0 = Instant::now();
    let gap = Duration::from_secs_f64(1.0 / 300.0);
    let (_, w) = counting();
    let first = p.ticket();
    let second = p.ticket();
    assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
    // The timer fires on the millisecond, a little after the turn's instant; the turn
    // after is still one gap after the instant, not after the late wake-up.
    tokio::time::advance(Duration::from_millis(4)).await;
    assert_eq!(p.poll_turn(second, &w), Turn::Go(0));
    let third = p.ticket();
    assert_eq!(p.poll_turn(third, &w), Turn::Wait(t0 + gap * 2));
    // After a quiet spell longer than a gap, the schedule starts again from now.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(p.poll_turn(third, &w), Turn::Go(0));
    let fourth = p.ticket();
    assert_eq!(
        p.poll_turn(fourth, &w),
        Turn::Wait(t0 + Duration::from_millis(1004) + gap)
    );
}

#[tokio::test(start_paused = true)]
async fn slow_start_doubles_every_second_of_line_and_ends_halving_at_a_refusal() {
    let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
    let (_, w) = counting();
    // A line of many: each turn after the first doubles the rate by 2^(time since the
    // last turn).
    let tickets: Vec<_> = (0..100).map(|_| p.ticket()).collect();
    assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
    for &t in &tickets[1..11] {
        let Turn::Wait(at) = p.poll_turn(t, &w) else {
            panic!("the head waits for its instant");
        };
        tokio::time::advance(at - Instant::now()).await;
        assert_eq!(p.poll_turn(t, &w), Turn::Go(0));
    }
    // Ten turns, each 1 / rate apart: the rate doubled for each second that passed.
    let mut want = 10.0f64;
    for _ in 0..10 {
        want *= (1.0 / want).exp2();
    }
    let rate = p.rate();
    assert!((rate - want).abs() < 1e-6, "{rate} against {want}");
    // Successes do not add to slow start's doubling.
    p.on_success();
    assert_eq!(p.rate(), rate);
    // The first refusal halves it and ends slow start.
    p.on_refusal(0, None);
    assert_eq!(p.rate(), rate * 0.5);
    // Growth is then the configured step per success, while anyone waits in line.
    p.on_success();
    assert_eq!(p.rate(), rate * 0.5 + 0.05);
    // Attempts sent before that decrease do not count again; later ones do, by 0.95.
    p.on_refusal(0, None);
    assert_eq!(p.rate(), rate * 0.5 + 0.05);
    p.on_refusal(1, None);
    assert!((p.rate() - (rate * 0.5 + 0.05) * 0.95).abs() < 1e-9);
}

#[test]
fn the_rate_grows_only_while_someone_waits_in_line() {
    let p = Pacer::new(
        eager()
            .rates(10.0, 2.0, 12.0)
            .unwrap()
            .decrease(0.5)
            .unwrap()
            .growth(0.5)
            .unwrap(),
    );
    let (_, w) = counting();
    p.on_refusal(0, None);
    assert_eq!(p.rate(), 5.0);
    // Nobody in line: the fleet sends less than its rate, which proves nothing.
    p.on_success();
    assert_eq!(p.rate(), 5.0);
    let _a = p.ticket();
    let b = p.ticket();
    assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
    p.on_success();
    assert_eq!(p.rate(), 5.5);
    // Never above max, never below min.
    for _ in 0..100 {
        p.on_success();
    }
    assert_eq!(p.rate(), 12.0);
    for e in 1..=10 {
        p.on_refusal(e, None);
    }
    assert_eq!(p.rate(), 2.0);
}

#[tokio::test(start_paused = true)]
async fn a_quota_retry_after_sets_the_rate_that_spreads_it_and_holds_it_a_cycle() {
    let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
    let (_, w) = counting();
    let t0 = Instant::now();
    // 6,000 turns in 12 s (at 500/s), then a 429 whose Retry-After is 48 s: the quota is
    // spent and renews at 60 s.
    let mut last = None;
    for _ in 0..6_000 {
        let t = p.ticket();
        loop {
            match p.poll_turn(t, &w) {
                Turn::Go(e) => break last = Some(e),
                Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                Turn::Queued { .. } => unreachable!("one ticket at a time"),
            }
        }
    }
    let elapsed = Instant::now() - t0;
    assert!(elapsed.as_secs_f64() > 11.99 && elapsed.as_secs_f64() < 12.0);
    p.on_refusal(last.unwrap(), Some(Duration::from_secs(48)));
    let cycle = elapsed + Duration::from_secs(48);
    let quota = 6_000.0 / cycle.as_secs_f64();
    assert!((p.rate() - quota).abs() < 1e-9, "{}", p.rate());
    // Someone waits in line, yet the rate holds through the wait and one cycle after it.
    let _a = p.ticket();
    let b = p.ticket();
    assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
    tokio::time::advance(Duration::from_secs(48) + cycle - Duration::from_millis(1)).await;
    p.on_success();
    assert!((p.rate() - quota).abs() < 1e-9);
    // Then it grows, up to 25 % above the quota's rate in the next cycle.
    tokio::time::advance(Duration::from_millis(1)).await;
    for _ in 0..10_000 {
        p.on_success();
    }
    assert!((p.rate() - quota * 1.25).abs() < 1e-9, "{}", p.rate());
    // And 25 % more in the cycle after that.
    tokio::time::advance(cycle).await;
    for _ in 0..10_000 {
        p.on_success();
    }
    assert!(
        (p.rate() - quota * 1.25 * 1.25).abs() < 1e-6,
        "{}",
        p.rate()
    );
}

#[test]
fn a_short_retry_after_is_no_quota() {
    let p = fixed(100.0);
    let (_, w) = counting();
    let t = p.ticket();
    assert_eq!(p.poll_turn(t, &w), Turn::Go(0));
    p.on_refusal(0, Some(Duration::from_secs(1)));
    // Only the halving that ends slow start.
    assert_eq!(p.rate(), 50.0);
}

#[tokio::test(start_paused = true)]
async fn a_stated_limit_caps_the_rate_in_slow_start_and_after() {
    let p = Pacer::new(eager().rates(50.0, 1.0, 1_000.0).unwrap());
    let (_, w) = counting();
    // 600 requests a minute: 10/s, below the rate it starts from.
    p.on_limit(600);
    assert_eq!(p.rate(), 10.0);
    // Slow start does not take it above the cap, however long the line.
    let tickets: Vec<_> = (0..50).map(|_| p.ticket()).collect();
    for &t in &tickets[..30] {
        loop {
            match p.poll_turn(t, &w) {
                Turn::Go(_) => break,
                Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                Turn::Queued { .. } => unreachable!("served in order"),
            }
        }
    }
    assert_eq!(p.rate(), 10.0);
    // Nor does growth after a refusal.
    p.on_refusal(0, None);
    assert_eq!(p.rate(), 5.0);
    for _ in 0..1_000 {
        p.on_success();
    }
    assert_eq!(p.rate(), 10.0);
    // A higher stated limit raises the cap, not the rate.
    p.on_limit(6_000);
    assert_eq!(p.rate(), 10.0);
    p.on_success();
    assert!((p.rate() - 10.05).abs() < 1e-9);
}

#[test]
fn stated_limits_can_be_ignored_and_the_period_changed() {
    let p = Pacer::new(eager().limit_period(None).unwrap());
    p.on_limit(60);
    assert_eq!(p.rate(), 50.0);
    let p = Pacer::new(eager().limit_period(Some(Duration::from_secs(1))).unwrap());
    p.on_limit(20);
    assert_eq!(p.rate(), 20.0);
    assert!(eager().limit_period(Some(Duration::ZERO)).is_err());
}

/// Takes `n` turns one after another, as fast as the rate allows; the last turn's epoch.
async fn take_turns(p: &Pacer, n: usize) -> u64 {
    let (_, w) = counting();
    let mut last = 0;
    for _ in 0..n {
        let t = p.ticket();
        loop {
            match p.poll_turn(t, &w) {
                Turn::Go(e) => break last = e,
                Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                Turn::Queued { .. } => unreachable!("one ticket at a time"),
            }
        }
    }
    last
}

#[tokio::test(start_paused = true)]
async fn a_second_quota_refusal_during_the_wait_is_the_same_quota() {
    let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
    let epoch = take_turns(&p, 6_000).await;
    p.on_refusal(epoch, Some(Duration::from_secs(48)));
    let quota = p.rate();
    assert!((quota - 100.0).abs() < 0.01, "{quota}");
    // An attempt sent after that decrease is refused too, with the wait that is left:
    // only the usual decrease, not a quota of one attempt.
    let epoch = take_turns(&p, 1).await;
    p.on_refusal(epoch, Some(Duration::from_secs(47)));
    assert!((p.rate() - quota * 0.95).abs() < 1e-9, "{}", p.rate());
}

#[tokio::test(start_paused = true)]
async fn a_refusal_without_a_quota_keeps_the_quota_count() {
    let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
    // 5,000 turns, a plain 429 (no Retry-After), 1,000 more, then the quota's 429 with
    // 48 s to wait: the quota counts all 6,000 since the first turn.
    let epoch = take_turns(&p, 5_000).await;
    p.on_refusal(epoch, None);
    let epoch = take_turns(&p, 1_000).await;
    p.on_refusal(epoch, Some(Duration::from_secs(48)));
    let rate = p.rate();
    // 10 s at 500/s, 4 s at 250/s after the halving (less the first turn's gap), plus the
    // 48 s wait.
    let want = 6_000.0 / (10.0 + 4.0 - 0.004 + 48.0);
    assert!((rate - want).abs() < 0.01, "{rate} against {want}");
}

#[test]
fn a_stated_limit_below_min_is_kept_and_rates_have_a_floor() {
    let p = Pacer::new(eager());
    // 30 requests a minute: 0.5/s, below the default minimum of 1/s.
    p.on_limit(30);
    assert_eq!(p.rate(), 0.5);
    p.on_refusal(0, None);
    assert!(p.rate() <= 0.5);
    assert!(eager().rates(1e-20, 1e-20, 1.0).is_err());
    assert!(eager().rates(0.001, 0.001, 1.0).is_ok());
}

#[test]
fn two_stated_limits_arriving_together_leave_the_later_one_in_force() {
    let p = Arc::new(Pacer::new(eager()));
    // One answer states 600 a minute; while it is between its check and the lock, another
    // states 60 a minute and is taken in whole.
    let other = p.clone();
    BEFORE_LIMIT_LOCK.with(|h| *h.borrow_mut() = Some(Box::new(move || other.on_limit(60))));
    p.on_limit(600);
    // Whichever went second under the lock is in force, and the record of the last limit
    // taken in agrees with it ...
    let (cap, last) = (p.lock().stated, p.stated_limit.load(Ordering::Relaxed));
    assert_eq!(
        cap,
        Some(last as f64 / 60.0),
        "{cap:?} in force, {last} recorded"
    );
    // ... so every later answer, which states 60 again, puts 1/s in force.
    p.on_limit(60);
    assert_eq!(p.lock().stated, Some(1.0));
    assert_eq!(p.rate(), 1.0);
}

/// The `check` and `wait` of a ticket behind the head.
fn queued(p: &Pacer, ticket: u64, w: &Waker) -> (Option<Instant>, Duration) {
    match p.poll_turn(ticket, w) {
        Turn::Queued { check, wait } => (check, wait),
        turn => panic!("{ticket} is behind the head, not {turn:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_head_that_does_not_take_its_turn_is_passed_over_after_the_grace() {
    // A turn every 250 ms.
    let p = fixed(4.0);
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let [first, stale, b, c] = [(); 4].map(|_| p.ticket());
    let (stale_count, stale_w) = counting();
    let (b_count, b_w) = counting();
    let (c_count, c_w) = counting();
    assert_eq!(p.poll_turn(first, &stale_w), Turn::Go(0));
    // The head waits for its turn at 250 ms, then is not polled again.
    assert_eq!(p.poll_turn(stale, &stale_w), Turn::Wait(t0 + ms(250)));
    // The one right behind it looks again when the head's grace is over; the one after
    // when that one should have gone. Both expect their turns on the schedule.
    assert_eq!(queued(&p, b, &b_w), (Some(t0 + ms(350)), ms(500)));
    assert_eq!(queued(&p, c, &c_w), (Some(t0 + ms(600)), ms(750)));
    // Within the grace the turn is still the head's.
    tokio::time::advance(ms(349)).await;
    assert_eq!(queued(&p, b, &b_w), (Some(t0 + ms(350)), ms(151)));
    // Then the one behind takes it, and the schedule holds: the next turn is at 500 ms.
    tokio::time::advance(ms(1)).await;
    assert_eq!(p.poll_turn(b, &b_w), Turn::Go(0));
    assert_eq!(p.lock().passed, 1);
    assert_eq!(woken(&c_count), 1);
    assert_eq!(p.poll_turn(c, &c_w), Turn::Wait(t0 + ms(500)));
    // Polled again, the head passed over does not go at once: it comes back right
    // behind the head of the moment, and is told when its turn is next.
    assert_eq!(queued(&p, stale, &stale_w), (Some(t0 + ms(600)), ms(400)));
    let d = p.ticket();
    assert_eq!(queued(&p, d, &b_w), (Some(t0 + ms(850)), ms(650)));
    tokio::time::advance(ms(150)).await;
    assert_eq!(p.poll_turn(c, &c_w), Turn::Go(0));
    assert_eq!(woken(&stale_count), 1);
    assert_eq!(p.poll_turn(stale, &stale_w), Turn::Wait(t0 + ms(750)));
    tokio::time::advance(ms(250)).await;
    assert_eq!(p.poll_turn(stale, &stale_w), Turn::Go(0));
    assert_eq!(woken(&b_count), 1);
    assert_eq!(p.poll_turn(d, &b_w), Turn::Wait(t0 + ms(1_000)));
    assert_eq!(p.lock().passed, 1);
}

#[tokio::test(start_paused = true)]
async fn a_run_of_heads_not_polled_is_passed_over_by_the_first_that_looks() {
    // A turn every 100 ms. The head, and the one behind it, are polled once and then not
    // again; the third looks when the second should have gone.
    let p = fixed(10.0);
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let [first, s1, s2, live] = [(); 4].map(|_| p.ticket());
    let (_, w) = counting();
    assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
    assert_eq!(p.poll_turn(s1, &w), Turn::Wait(t0 + ms(100)));
    assert_eq!(queued(&p, s2, &w).0, Some(t0 + ms(200)));
    assert_eq!(queued(&p, live, &w).0, Some(t0 + ms(300)));
    // The first lapsed at 200 ms; the second was called to the head then and lapsed at
    // 300 ms. The third passes both over and goes.
    tokio::time::advance(ms(300)).await;
    assert_eq!(p.poll_turn(live, &w), Turn::Go(0));
    assert_eq!(p.lock().passed, 2);
    // Polled again, they come back in the order they look, and take the next turns; a
    // newcomer queues behind them.
    assert_eq!(p.poll_turn(s2, &w), Turn::Wait(t0 + ms(400)));
    assert_eq!(queued(&p, s1, &w).1, ms(200));
    let newcomer = p.ticket();
    assert_eq!(queued(&p, newcomer, &w).1, ms(300));
}

#[tokio::test(start_paused = true)]
async fn the_expected_wait_counts_slow_starts_doubling() {
    let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
    let t0 = Instant::now();
    let (_, w) = counting();
    let tickets: Vec<_> = (0..101).map(|_| p.ticket()).collect();
    assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
    // 99 ahead of the last, behind a head whose turn is at 100 ms: at a rate doubling
    // every second, 99 turns take log2(1 + 99 ln 2 / 10) s, not 9.9 s.
    let (check, wait) = queued(&p, tickets[100], &w);
    let want = 0.1 + (1.0 + 99.0 * LN_2 / 10.0).log2();
    assert!((wait.as_secs_f64() - want).abs() < 1e-6, "{wait:?}");
    // It looks again when the one ahead of it would go at the rate of the moment.
    let check = check.unwrap() - t0;
    assert!(
        (check.as_secs_f64() - (0.1 + 9.8 + 0.1)).abs() < 1e-6,
        "{check:?}"
    );
    // Once slow start is over, the wait is at the rate (halved by the refusal).
    p.on_refusal(0, None);
    let (_, wait) = queued(&p, tickets[100], &w);
    assert!(
        (wait.as_secs_f64() - (0.1 + 99.0 / 5.0)).abs() < 1e-6,
        "{wait:?}"
    );
    // Up to a ceiling, then at it: a stated 1,200 a minute (20/s).
    let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
    p.on_limit(1_200);
    let tickets: Vec<_> = (0..101).map(|_| p.ticket()).collect();
    assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
    let (_, wait) = queued(&p, tickets[100], &w);
    let to_ceiling = 10.0 / LN_2;
    let want = 0.1 + 1.0 + (99.0 - to_ceiling) / 20.0;
    assert!((wait.as_secs_f64() - want).abs() < 1e-6, "{wait:?}");
}

#[tokio::test(start_paused = true)]
async fn leaving_the_line_when_passed_over_or_come_back_frees_the_place() {
    let p = fixed(10.0);
    let (_, w) = counting();
    let [first, a, b, c] = [(); 4].map(|_| p.ticket());
    assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
    assert!(matches!(p.poll_turn(a, &w), Turn::Wait(_)));
    assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
    assert!(matches!(p.poll_turn(c, &w), Turn::Queued { .. }));
    // `a` does not take its turn; `b` takes it when the grace is over.
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(p.poll_turn(b, &w), Turn::Go(0));
    assert_eq!(p.lock().front(), (Some(c), None));
    // Passed over and not come back, `a` holds no place: leaving changes nothing.
    p.abandon(a);
    assert_eq!(p.lock().front(), (Some(c), None));
    // Come back, then gone again: the place behind the head is free once more.
    assert!(matches!(p.poll_turn(a, &w), Turn::Queued { .. }));
    assert_eq!(p.lock().front(), (Some(c), Some(a)));
    p.abandon(a);
    assert_eq!(p.lock().front(), (Some(c), None));
    assert!(p.lock().waiting.is_empty());
    // A refusal leaves the line too, and is counted.
    assert_eq!(p.refused(), 0);
    assert_eq!(p.refuse(c), 1);
    assert_eq!(p.lock().front(), (None, None));
    assert_eq!(p.refused(), 1);
}

/// A dormant pacing that counted `n` attempts, one every `every`.
async fn dormant_after(n: u64, every: Duration) -> Pacer {
    let p = Pacer::new(eager().dormant(true));
    for _ in 0..n {
        assert!(!p.is_awake());
        p.dormant_send();
        tokio::time::advance(every).await;
    }
    p
}

#[tokio::test(start_paused = true)]
async fn a_dormant_pacing_wakes_at_the_rate_it_measured_halved() {
    // 500/s for 12 s; a refusal with a short Retry-After.
    let p = dormant_after(6_000, Duration::from_millis(2)).await;
    p.wake_on_refusal(
        Some(Duration::from_secs(1)),
        PacingWake::LongRetryAfter,
        None,
    );
    assert!(p.is_awake());
    assert!((p.rate() - 250.0).abs() < 1e-6, "{}", p.rate());
    // Out of slow start: the next refusal is the usual decrease.
    let t = p.ticket();
    let (_, w) = counting();
    let Turn::Go(epoch) = p.poll_turn(t, &w) else {
        panic!("the first turn after the wake goes at once");
    };
    p.on_refusal(epoch, None);
    assert!((p.rate() - 250.0 * 0.95).abs() < 1e-6, "{}", p.rate());
}

#[tokio::test(start_paused = true)]
async fn a_dormant_pacing_woken_by_a_quota_reads_it_from_everything_it_counted() {
    // 6,000 in 12 s, then the window's 429 with 48 s to its reset: 6,000 per 60 s.
    let p = dormant_after(6_000, Duration::from_millis(2)).await;
    p.wake_on_refusal(Some(Duration::from_secs(48)), PacingWake::QuotaReset, None);
    assert!((p.rate() - 100.0).abs() < 1e-6, "{}", p.rate());
}

#[tokio::test(start_paused = true)]
async fn a_long_lived_fleet_reads_a_quota_from_its_last_minute_not_its_lifetime() {
    // An hour at 5/s (18,000), then 12 s at 500/s (6,000), then a 429 with 48 s to the
    // reset: read against the last minute (48 s at 5/s and the 6,000), not the hour.
    let p = dormant_after(18_000, Duration::from_millis(200)).await;
    for _ in 0..6_000 {
        p.dormant_send();
        tokio::time::advance(Duration::from_millis(2)).await;
    }
    p.wake_on_refusal(Some(Duration::from_secs(48)), PacingWake::QuotaReset, None);
    // (6,000 + 240) over the 60 s counted and the 48 s to wait: about 58/s; over the
    // whole life it would be about 6/s.
    let rate = p.rate();
    assert!((50.0..70.0).contains(&rate), "{rate}");
}

#[tokio::test(start_paused = true)]
async fn a_young_or_slow_dormant_fleet_wakes_no_lower_than_initial() {
    // 3 attempts, then a 429: three in a second is no measure of the server.
    let p = dormant_after(3, Duration::from_millis(10)).await;
    p.wake_on_refusal(None, PacingWake::RefusalShare, None);
    assert_eq!(p.rate(), 50.0);
    // None counted at all: the same.
    let p = Pacer::new(eager().dormant(true));
    p.wake_on_refusal(None, PacingWake::RefusalShare, None);
    assert_eq!(p.rate(), 50.0);
}

#[tokio::test(start_paused = true)]
async fn a_stated_limit_caps_a_dormant_pacing_without_waking_it() {
    // 200 attempts a second, while every answer states 600 a minute (10/s).
    let p = dormant_after(200, Duration::from_millis(5)).await;
    p.on_limit(600);
    assert!(
        !p.is_awake(),
        "a client within its stated limit is not slowed"
    );
    // Woken by a refusal, it starts from the cap, not from what it measured (200/s),
    // halved as every wake is.
    p.wake_on_refusal(None, PacingWake::RefusalShare, None);
    assert!(p.is_awake());
    assert_eq!(p.rate(), 5.0);
    assert!(Pacer::new(eager()).is_awake());
    assert!(eager().burst(Duration::from_secs(61)).is_err());
}

#[test]
fn a_nearly_spent_limit_wakes_a_dormant_pacing_at_its_cap() {
    let p = Pacer::new(eager().dormant(true));
    // No limit in force: nothing to wake at.
    p.wake_on_limit();
    assert!(!p.is_awake());
    p.on_limit(600);
    p.wake_on_limit();
    assert!(p.is_awake());
    assert_eq!(p.rate(), 10.0);
}
