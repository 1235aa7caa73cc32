package agent

import "sync"

// Report queue. Peers' report messages wait for the loop verified but
// encoded (queuedReport), per sender in arrival order, within a byte
// budget (inbox.limit); the loop takes the oldest message of all. A message
// that takes the queue over its budget makes room by dropping the oldest
// messages of the sender holding the most bytes (ReasonOverflow), down to
// that sender's newest message, which is always kept: a sender that floods
// the queue loses its own oldest reports, not the others' reports, and
// what the loop finally reads of every sender is its newest.
//
// Why dropping is safe and live: reports carry cumulative counters and
// the ledger merges them by max (the ledger package doc), so a lost report
// changes nothing but timing. What a dropped report said of a key that no
// later report repeats comes back with the sender's next full report
// (every FullEvery-th carries every active key), and its acknowledgements
// and positions are superseded by those of the newer report kept. Keeping
// the newest rather than the oldest (a full channel dropped the newest)
// also keeps the acknowledgements the loop reads fresh, which is what
// holds the peers' leases (ledger.Tick fences on a lapsed lease).
//
// The budget (limit): per sender with messages queued, 5/4 of the most
// report bytes this agent published in one tick recently (every part of
// every message, peakPublished: a peer of the same rules sends reports of
// about the same size, so a full report of each sender fits with a partial
// one behind it, also when it comes as a message per part), and at least
// minQueueBytes per sender.
type inbox struct {
	mu      sync.Mutex
	senders map[string]*senderQueue
	seq     uint64
	n       int           // messages queued
	bytes   int64         // their bytes
	ready   chan struct{} // capacity 1: a message is queued
}

type senderQueue struct {
	q     []queuedReport
	bytes int64
}

// minQueueBytes is the least budget per sender.
const minQueueBytes = 4 << 20

// maxQueued bounds the messages queued whatever their senders (the budget
// grows with the senders, and without signatures every subject token is
// one): past it the oldest message of all goes.
const maxQueued = 1024

func newInbox() *inbox {
	return &inbox{senders: map[string]*senderQueue{}, ready: make(chan struct{}, 1)}
}

// limit is the queue's budget for senders senders, given the largest
// report this agent published recently.
func queueLimit(senders int, published int64) int64 {
	return int64(max(1, senders)) * max(minQueueBytes, published*5/4)
}

// push queues q and returns the messages dropped to make room, to be
// counted by the caller; published is peakPublished.
func (b *inbox) push(q queuedReport, published int64) (dropped []queuedReport) {
	b.mu.Lock()
	s := b.senders[q.from]
	if s == nil {
		s = &senderQueue{}
		b.senders[q.from] = s
	}
	b.seq++
	q.seq = b.seq
	s.q = append(s.q, q)
	s.bytes += int64(len(q.data))
	b.n, b.bytes = b.n+1, b.bytes+int64(len(q.data))
	limit := queueLimit(len(b.senders), published)
	for b.bytes > limit {
		var big *senderQueue
		for _, c := range b.senders {
			if len(c.q) > 1 && (big == nil || c.bytes > big.bytes) {
				big = c
			}
		}
		if big == nil {
			break // one message of each sender: kept
		}
		dropped = append(dropped, b.drop(big))
	}
	for b.n > maxQueued { // senders without number (a subject token each, unsigned)
		dropped = append(dropped, b.drop(b.oldest()))
	}
	b.mu.Unlock()
	select {
	case b.ready <- struct{}{}:
	default:
	}
	return dropped
}

// oldest is the sender of the oldest queued message (nil: none).
func (b *inbox) oldest() *senderQueue {
	var first *senderQueue
	for _, s := range b.senders {
		if first == nil || s.q[0].seq < first.q[0].seq {
			first = s
		}
	}
	return first
}

// drop removes s's oldest message and returns it; a sender whose last
// message goes is forgotten (only senders with messages are kept).
func (b *inbox) drop(s *senderQueue) queuedReport {
	q := s.q[0]
	s.q[0] = queuedReport{}
	s.q = s.q[1:]
	s.bytes -= int64(len(q.data))
	b.n, b.bytes = b.n-1, b.bytes-int64(len(q.data))
	if len(s.q) == 0 {
		delete(b.senders, q.from)
	}
	return q
}

// pop takes the oldest queued message, if any, and signals ready again
// while more wait.
func (b *inbox) pop() (queuedReport, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	first := b.oldest()
	if first == nil {
		return queuedReport{}, false
	}
	q := b.drop(first)
	if b.n > 0 {
		select {
		case b.ready <- struct{}{}:
		default:
		}
	}
	return q, true
}

// queued is the bytes of the messages in the queue.
func (b *inbox) queued() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.bytes
}
