package launch

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy is a TCP proxy on loopback that forwards every byte after a
// fixed one-way delay, in both directions: the WAN between two regions'
// NATS gateways. Bytes keep their order; a chunk read at t is written at
// t + delay (later if the peer is slow to read).
//
// A cut proxy (SetCut) is a severed link: it has closed every connection
// through it and closes each new one as soon as it accepts it, until the
// cut is lifted.
//
// A gateway proxy (NewGatewayProxy) carries one NATS gateway link and
// filters the gateway URLs out of what it forwards (GatewayFilter, and
// gateway.go for why), so that the servers only ever dial the proxies
// they were configured with.
//
// Its goroutines (the accept loop and, per connection, a reader and a
// writer per direction) are owned by the proxy: Close stops accepting,
// closes every connection and waits for them. Safe to call twice.
type Proxy struct {
	ln      net.Listener
	target  string
	delay   time.Duration
	gateway bool // filter the NATS gateway protocol (gatewayFilter)

	wg sync.WaitGroup
	mu sync.Mutex
	// conns are the open connections, accepted (false) and dialled to the
	// target (true).
	conns  map[net.Conn]bool // guarded by mu
	closed bool              // guarded by mu
	cut    bool              // guarded by mu
}

// NewDelayProxy listens on a free loopback port and forwards to target.
func NewDelayProxy(target string, delay time.Duration) (*Proxy, error) {
	return startProxy(target, delay, false)
}

// NewGatewayProxy is a delay proxy for one NATS gateway link, dialled by
// one region's server to reach another's gateway (target): in what the
// target sends, gossip INFOs are dropped and the gateway URLs set to the
// proxy's own address; in what the dialler sends, the gateway URLs are
// removed.
func NewGatewayProxy(target string, delay time.Duration) (*Proxy, error) {
	return startProxy(target, delay, true)
}

func startProxy(target string, delay time.Duration, gateway bool) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, delay: delay, gateway: gateway, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Delay is the proxy's one-way delay.
func (p *Proxy) Delay() time.Duration { return p.delay }

// Addr is the address to connect to instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) track(c net.Conn, dialled bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.cut {
		c.Close()
		return false
	}
	p.conns[c] = dialled
	return true
}

// UpstreamPorts are the local ports of the connections the proxy has open
// to its target: what the target sees as the remote ports of the
// connections that came through the proxy.
func (p *Proxy) UpstreamPorts() map[int]bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	ports := map[int]bool{}
	for c, dialled := range p.conns {
		if a, ok := c.LocalAddr().(*net.TCPAddr); ok && dialled {
			ports[a.Port] = true
		}
	}
	return ports
}

// IsCut reports whether the link is cut (SetCut).
func (p *Proxy) IsCut() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

// SetCut severs the link (cut) or restores it. Cutting closes every
// connection through the proxy; while cut, new connections are accepted and
// closed at once. Safe to call concurrently with Close and after it.
func (p *Proxy) SetCut(cut bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = cut
	if !cut {
		return
	}
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		if p.IsCut() {
			in.Close()
			continue
		}
		out, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			in.Close()
			continue
		}
		if !p.track(in, false) || !p.track(out, true) {
			in.Close()
			out.Close()
			continue
		}
		var up, down io.Reader = in, out
		if p.gateway {
			up = NewGatewayFilter(in, "")          // the dialler's INFO: no URLs for the target to learn
			down = NewGatewayFilter(out, p.Addr()) // the target's: the dialler reaches it here only
		}
		var ended atomic.Int32 // the pipes done; the second forgets the pair
		forget := func() {
			if ended.Add(1) == 2 {
				p.untrack(in, out)
			}
		}
		p.wg.Add(2)
		go p.pipe(up, in, out, forget)
		go p.pipe(down, out, in, forget)
	}
}

// untrack closes the connections of a pair whose pipes have both ended and
// forgets them.
func (p *Proxy) untrack(in, out net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	in.Close()
	out.Close()
	delete(p.conns, in)
	delete(p.conns, out)
}

type chunk struct {
	due  time.Time
	data []byte
}

// pipe copies r, which reads src, to dst, each chunk delay after it was
// read, and calls ended when done. When either side fails, both
// connections are closed (the other direction ends too).
func (p *Proxy) pipe(r io.Reader, src, dst net.Conn, ended func()) {
	defer p.wg.Done()
	defer ended()
	q := make(chan chunk, 4096)
	done := make(chan struct{})
	go func() { // writer, owned by this pipe: it ends before pipe returns
		defer close(done)
		for c := range q {
			if d := time.Until(c.due); d > 0 {
				time.Sleep(d)
			}
			if _, err := dst.Write(c.data); err != nil {
				src.Close()
				dst.Close()
				for range q { // drain so the reader never blocks
				}
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			q <- chunk{due: time.Now().Add(p.delay), data: append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				dst.Close()
			}
			break
		}
	}
	close(q)
	<-done
	if tc, ok := dst.(*net.TCPConn); ok {
		tc.CloseWrite() // pass the EOF on, after the delayed bytes
	}
}

// Close stops the proxy and every connection through it, and waits for its
// goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.ln.Close()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
