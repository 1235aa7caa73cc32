package client

import (
	"context"
	"errors"
	"sync"
	"time"
)

// batcher coalesces concurrent Check calls into CheckLimits calls. The batch
// being filled belongs to the loop goroutine alone; each full batch is sent
// by a goroutine of its own, so the next batch fills while one is in flight.
// Every request the loop accepted is answered exactly once.
type batcher struct {
	c      *Client
	in     chan *pending
	ctx    context.Context // cancelled by close
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type pending struct {
	req  Request
	done chan result // buffered: the sender never waits for a caller that left
}

type result struct {
	d   Decision
	err error
}

func startBatcher(c *Client) *batcher {
	ctx, cancel := context.WithCancel(context.Background())
	b := &batcher{c: c, in: make(chan *pending), ctx: ctx, cancel: cancel}
	b.wg.Add(1)
	go b.loop()
	return b
}

func (b *batcher) close() {
	b.cancel()
	b.wg.Wait()
}

func (b *batcher) check(ctx context.Context, req Request) (Decision, error) {
	if err := validate(req); err != nil {
		return Decision{}, err
	}
	p := &pending{req: req, done: make(chan result, 1)}
	select {
	case b.in <- p:
	case <-ctx.Done():
		return Decision{}, ctx.Err()
	case <-b.ctx.Done():
		return Decision{}, ErrClosed
	}
	select {
	case r := <-p.done:
		return r.d, r.err
	case <-ctx.Done():
		return Decision{}, ctx.Err()
	}
}

func (b *batcher) loop() {
	defer b.wg.Done()
	var batch []*pending
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	flush := func() {
		timer.Stop()
		full := batch
		batch = nil
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			b.send(full)
		}()
	}
	for {
		select {
		case p := <-b.in:
			batch = append(batch, p)
			if len(batch) == 1 {
				timer.Reset(b.c.cfg.batchWin)
			}
			if len(batch) >= b.c.cfg.batchMax {
				flush()
			}
		case <-timer.C:
			if len(batch) > 0 {
				flush()
			}
		case <-b.ctx.Done():
			timer.Stop()
			for _, p := range batch {
				p.done <- result{err: ErrClosed}
			}
			return
		}
	}
}

// send asks about one batch. A request the enforcer refuses is answered with
// its error alone and the others are asked again without it, so one bad
// request never fails its neighbours.
func (b *batcher) send(live []*pending) {
	for len(live) > 0 {
		reqs := make([]Request, len(live))
		for i, p := range live {
			reqs[i] = p.req
		}
		ds, err := b.c.checkLimits(b.ctx, reqs)
		if err == nil {
			for i, p := range live {
				p.done <- result{d: ds[i]}
			}
			return
		}
		var re *RequestError
		if errors.As(err, &re) && re.Field != "requests" && re.Index < len(live) {
			live[re.Index].done <- result{err: &RequestError{Field: re.Field, Msg: re.Msg}}
			live = append(live[:re.Index:re.Index], live[re.Index+1:]...)
			continue
		}
		if b.ctx.Err() != nil {
			err = ErrClosed
		}
		for _, p := range live {
			p.done <- result{err: err}
		}
		return
	}
}
