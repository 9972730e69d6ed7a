//! Sending a turn's undelivered events as its client takes them: the one
//! loop both a running turn and an ended one (trailing its client) use, so
//! the two cannot disagree on what a full or a closed channel means.

use std::collections::VecDeque;

use tokio::sync::mpsc;

/// How sending a backlog ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Every event went out; the backlog is empty.
    Drained,
    /// The channel is full: the events it did not take stay in the
    /// backlog, in order, the first of them at its front.
    Full,
    /// The client is gone (its receiver dropped): the event it refused is
    /// dropped, the rest stay in the backlog for the caller to drop.
    Closed,
}

/// Sends `backlog`'s events in order while `events` takes them, without
/// waiting: the driver's loop must never block on one client.
pub(crate) fn send_backlog<T>(events: &mpsc::Sender<T>, backlog: &mut VecDeque<T>) -> Sent {
    while let Some(event) = backlog.pop_front() {
        match events.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(event)) => {
                backlog.push_front(event);
                return Sent::Full;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Sent::Closed,
        }
    }
    Sent::Drained
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Back-pressure (issue 16, deliverable 5): a full channel keeps the
    /// events it did not take, in order, and they go out once the client
    /// reads; a gone client ends the sending. Pins the order a stalled
    /// stream resumes in (no event lost or repeated) and that a closed
    /// channel is told apart from a full one (the driver cancels the turn
    /// of a gone client, but parks a slow one).
    #[test]
    fn a_backlog_goes_out_in_order_as_the_client_reads() {
        let (tx, mut rx) = mpsc::channel(2);
        let mut backlog: VecDeque<u32> = (1..=5).collect();
        assert_eq!(send_backlog(&tx, &mut backlog), Sent::Full);
        assert_eq!(backlog, [3, 4, 5]);
        assert_eq!(rx.try_recv().ok(), Some(1));
        assert_eq!(send_backlog(&tx, &mut backlog), Sent::Full);
        assert_eq!(backlog, [4, 5]);
        assert_eq!((rx.try_recv().ok(), rx.try_recv().ok()), (Some(2), Some(3)));
        assert_eq!(send_backlog(&tx, &mut backlog), Sent::Drained);
        assert!(backlog.is_empty());
        assert_eq!(send_backlog(&tx, &mut backlog), Sent::Drained);
        backlog.push_back(6);
        drop(rx);
        assert_eq!(send_backlog(&tx, &mut backlog), Sent::Closed);
    }
}
