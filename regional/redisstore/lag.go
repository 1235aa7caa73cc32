package redisstore

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// lagProbe measures how late this process hears the network: every
// lagInterval it writes a byte into one end of a local socket pair and
// reads it from the other, the way a worker reads a Redis reply (through
// the runtime's network poller and then the run queue), and records how
// long that took.
//
// Why: a check blames Redis only for silence it could have heard. Under
// this process's own load a reply can sit unread in the socket while the
// goroutine that reads it waits its turn (the poller is consulted less often
// when every CPU is busy); timers, by contrast, wake their goroutine first. Without the lag a burst of callers would see "no answer"
// from a healthy Redis, fail open, and open the breaker. With it, a Redis
// that stops answering while the process is idle still fails the checks
// after the round-trip budget.
type lagProbe struct {
	last    atomic.Int64 // ns: the latest measured lag, decayed
	pending atomic.Int64 // unix ns when the current measurement began; 0 when none
	tick    atomic.Int64 // unix ns of the probe's latest tick
}

const lagInterval = 2 * time.Millisecond

// current is the lag now: the last measurement, or the yield in progress
// if that has already taken longer.
//
// It also counts a probe that has not ticked for a while: a process whose
// CPU was taken away (a container's CPU quota spent, a stopped VM) resumes
// with every timer late, and its checks must not blame Redis for the pause.
func (p *lagProbe) current() time.Duration {
	l := time.Duration(p.last.Load())
	if start := p.pending.Load(); start != 0 {
		l = max(l, time.Since(time.Unix(0, start)))
	}
	if t := p.tick.Load(); t != 0 {
		l = max(l, time.Since(time.Unix(0, t))-lagInterval)
	}
	return l
}

func (p *lagProbe) run(done <-chan struct{}) {
	w, r, err := socketPair()
	if err != nil {
		p.runSched(done) // no socket pair on this platform
		return
	}
	defer w.Close()
	// The reader sleeps in the poller, as a worker waiting for Redis does,
	// and measures how long a byte took to reach it.
	read := make(chan struct{})
	go func() {
		defer close(read)
		buf := make([]byte, 8)
		for {
			if _, err := io.ReadFull(r, buf); err != nil {
				return
			}
			sent := int64(binary.LittleEndian.Uint64(buf))
			p.record(time.Since(time.Unix(0, sent)))
		}
	}()
	defer func() { r.Close(); <-read }()
	t := time.NewTicker(lagInterval)
	defer t.Stop()
	buf := make([]byte, 8)
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		p.tick.Store(time.Now().UnixNano())
		if p.pending.Load() != 0 {
			continue // the previous byte is still on its way
		}
		now := time.Now().UnixNano()
		p.pending.Store(now)
		binary.LittleEndian.PutUint64(buf, uint64(now))
		if _, err := w.Write(buf); err != nil {
			return
		}
	}
}

// runSched measures the run queue alone: runtime.Gosched waits behind every
// runnable goroutine.
func (p *lagProbe) runSched(done <-chan struct{}) {
	t := time.NewTicker(lagInterval)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		start := time.Now()
		p.tick.Store(start.UnixNano())
		p.pending.Store(start.UnixNano())
		runtime.Gosched()
		p.record(time.Since(start))
	}
}

// record stores one measurement: rise at once, fall slowly (a quarter per
// sample), so that one quiet moment inside a burst does not hide the burst.
func (p *lagProbe) record(d time.Duration) {
	if old := time.Duration(p.last.Load()); d < old {
		d = old - (old-d)/4
	}
	p.last.Store(int64(d))
	p.pending.Store(0)
}

// socketPair returns the two ends of a connected local stream socket pair,
// both served by the runtime's network poller.
func socketPair() (net.Conn, net.Conn, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, nil, err
	}
	conn := func(fd int, name string) (net.Conn, error) {
		f := os.NewFile(uintptr(fd), name)
		defer f.Close() // FileConn dups the descriptor
		return net.FileConn(f)
	}
	a, err := conn(fds[0], "lag-probe-w")
	if err != nil {
		syscall.Close(fds[1])
		return nil, nil, err
	}
	b, err := conn(fds[1], "lag-probe-r")
	if err != nil {
		a.Close()
		return nil, nil, err
	}
	return a, b, nil
}

// Activity records when bytes last arrived from Redis on any connection
// dialed through its Dialer. A Store given it (WithActivity) hears Redis
// answering as each reply arrives, not only when a whole pipeline is done:
// a long pipeline (a CheckLimits of hundreds) then never looks like silence.
//
// It also knows its open connections, so that a check about to blame Redis
// for silence can ask the kernel whether a reply has in fact arrived and
// waits unread in a socket (this process, not Redis, is behind: see Unread).
//
// It keeps the same two times per address dialed too (a Redis Cluster's
// node), so that a Cluster store tells one master's silence from another's
// (see the package doc, "Redis Cluster").
type Activity struct {
	last    atomic.Int64 // unix ns
	wrote   atomic.Int64 // unix ns when a write to Redis last completed, or a dial began
	scripts atomic.Int64 // unix ns when a write beginning with a script call (EVALSHA) last completed
	dialed  atomic.Int64 // unix ns when a dial last began
	mu      sync.Mutex
	conns   map[*activityConn]struct{}
	nodes   map[string]*nodeActivity // by address dialed
}

// nodeActivity is an Activity's last, wrote, scripts and dialed for the
// connections to one address.
type nodeActivity struct {
	last, wrote, scripts, dialed atomic.Int64
}

// NewActivity returns an Activity that has heard nothing yet.
func NewActivity() *Activity {
	return &Activity{conns: map[*activityConn]struct{}{}, nodes: map[string]*nodeActivity{}}
}

// node is the record of the connections to addr, made on first use.
func (a *Activity) node(addr string) *nodeActivity {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := a.nodes[addr]
	if n == nil {
		n = &nodeActivity{}
		a.nodes[addr] = n
	}
	return n
}

// Dialer wraps dial (go-redis's Options.Dialer, for example
// redis.NewDialer(opts) to keep its TLS and timeouts) so that every read
// that returns bytes is recorded.
func (a *Activity) Dialer(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		n := a.node(addr)
		now := time.Now().UnixNano()
		a.wrote.Store(now) // a dial that hangs is Redis unreachable
		n.wrote.Store(now)
		a.dialed.Store(now)
		n.dialed.Store(now)
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		ac := &activityConn{Conn: c, a: a, n: n}
		a.mu.Lock()
		a.conns[ac] = struct{}{}
		a.mu.Unlock()
		if sc, ok := c.(syscall.Conn); ok {
			return &activitySysConn{ac, sc}, nil
		}
		return ac, nil
	}
}

// Unread reports whether some connection holds bytes from Redis that the
// kernel has received and this process has not read yet: Redis has
// answered, and the reader is waiting for a CPU. Where the kernel cannot be
// asked (not Linux, a connection without a file descriptor) it is false.
func (a *Activity) Unread() bool { return a.unread(nil) }

// unread is Unread for the connections of n (nil: every connection).
func (a *Activity) unread(n *nodeActivity) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for c := range a.conns {
		if n != nil && c.n != n {
			continue
		}
		if sc, ok := c.raw(); ok {
			if n, ok := unreadBytes(sc); ok && n > 0 {
				return true
			}
		}
	}
	return false
}

type activityConn struct {
	net.Conn
	a *Activity
	n *nodeActivity // its address's
}

// activitySysConn is an activityConn whose connection is a socket of its
// own (TCP, Unix: not TLS), exposed as go-redis's pool wants it: the pool
// peeks at an idle connection's socket before handing it out (its health
// check, internal/pool's connCheck, on every Get of the main and the
// pipeline pool) and drops one whose peer has closed it (Redis's idle
// timeout, a restart). A connection that is no syscall.Conn passes that
// check unlooked at: embedding net.Conn alone would hide the method, and
// the pool would send the next pipeline into a closed socket, failing
// every check in it (the backend sets no client retries).
//
// A TLS connection stays an activityConn: go-redis does not look under
// TLS either (a post-handshake record waiting in the socket would make the
// check read through TLS, which may block), so there the pool cannot tell a
// closed idle connection, as without an Activity.
type activitySysConn struct {
	*activityConn
	sc syscall.Conn
}

// SyscallConn is the socket's, for go-redis's health check (read-only
// peeks: what it reads stays in the socket for Read).
func (c *activitySysConn) SyscallConn() (syscall.RawConn, error) { return c.sc.SyscallConn() }

func (c *activityConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		now := time.Now().UnixNano()
		c.a.last.Store(now)
		c.n.last.Store(now)
	}
	return n, err
}

// Write records when a write completed: before that the bytes may not have
// reached the kernel (the writer preempted), and Redis cannot answer them.
// (A write that blocks on a full socket buffer would not count either, but
// each worker has one pipeline in flight: the buffers do not fill.) A write
// that begins with a script call is a pipeline's scripts in Redis; any
// other may be a new connection's handshake (HELLO, CLIENT SETINFO), which
// costs Redis nothing (see Store.inRedis).
func (c *activityConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		now := time.Now().UnixNano()
		c.a.wrote.Store(now)
		c.n.wrote.Store(now)
		if isScriptCall(p) {
			c.a.scripts.Store(now)
			c.n.scripts.Store(now)
		}
	}
	return n, err
}

// isScriptCall reports whether p begins with an EVALSHA command as go-redis
// writes it (a RESP array whose first bulk string is the command's name):
// "*<n>\r\n$7\r\nevalsha\r\n", the name in any case.
func isScriptCall(p []byte) bool {
	if len(p) < 2 || p[0] != '*' {
		return false
	}
	i := 1
	for i < len(p) && i < 12 && p[i] >= '0' && p[i] <= '9' {
		i++
	}
	const head = "\r\n$7\r\n"
	if i == 1 || len(p) < i+len(head)+len("evalsha") || string(p[i:i+len(head)]) != head {
		return false
	}
	name := p[i+len(head) : i+len(head)+len("evalsha")]
	for k, ch := range []byte("evalsha") {
		if name[k]|0x20 != ch {
			return false
		}
	}
	return true
}

func (c *activityConn) Close() error {
	c.a.mu.Lock()
	delete(c.a.conns, c)
	c.a.mu.Unlock()
	return c.Conn.Close()
}

// raw is the socket under c (under TLS too: encrypted bytes waiting are a
// reply waiting).
func (c *activityConn) raw() (syscall.Conn, bool) {
	nc := c.Conn
	if t, ok := nc.(interface{ NetConn() net.Conn }); ok {
		nc = t.NetConn()
	}
	sc, ok := nc.(syscall.Conn)
	return sc, ok
}
