package launch

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"strconv"
)

// Why the gateway proxies read the NATS protocol.
//
// Each region's NATS server is configured with one URL per peer region: the
// address of its own proxy to that peer. But nats-server (v2.15) also
// learns gateway URLs from its peers, and no server option turns that off:
//
//   - When server B accepts a gateway connection from A, it sends A a
//     "gossip" INFO (gateway_cmd 1) for every other gateway C it knows,
//     with the URLs B uses for C: B's own proxy to C
//     (gossipGatewaysToInboundGateway). A adds them to its URLs for C
//     (processImplicitGateway -> addURLs), although C is configured.
//   - Every gateway INFO carries gateway_urls, the sender's advertised
//     address(es), which the receiver adds to its URLs for the sender
//     (updateURLs on an outbound, processImplicitGateway on an inbound).
//
// A server dials its URLs for a peer in random order, each time it
// (re)connects. So after a reconnect, A's connection to C often went
// through B's proxy to C: not cut when A was cut off (only the proxies
// from and to A were), so A's messages kept reaching C while C's no longer
// reached A — a one-way partition. Gateway.Advertise is one address for
// all peers, RejectUnknown only rejects gateways that are not configured,
// ConnectRetries only bounds implicit gateways: none of them keeps the
// gossip out.
//
// So the proxy of each link (A -> C) filters what it forwards
// (NewGatewayProxy; put in front of a proxy that does not read the
// protocol, such as toxiproxy): it drops
// gossip INFOs, and rewrites gateway_urls in the INFO C sends A to its own
// address (C advertises, per peer, the address that peer reaches it at)
// and removes them from the INFO A sends C. Every URL a server ever holds
// for a peer is then the one it was configured with, its own proxy to
// that peer, and every connection goes through that pair's proxy,
// reconnects included.

// gatewayCmdGossip is the gateway_cmd of an INFO that tells the receiver
// of another gateway's URLs (nats-server's gatewayCmdGossip).
const gatewayCmdGossip = 1

// GatewayFilter reads one direction of a NATS gateway connection and
// hands on the same protocol, except its INFO lines: a gossip INFO is
// dropped, and the gateway URLs of any other INFO are set to advertise,
// or removed when advertise is "". Message payloads (the bytes after an
// RMSG, HMSG and the like) pass untouched. A line too long for its buffer
// is passed on as it is (no INFO is that long).
type GatewayFilter struct {
	r         *bufio.Reader
	advertise string
	payload   int    // bytes of a message (payload and CRLF) still to pass on as they are
	midLine   bool   // passing on the rest of a line too long to look at
	out       []byte // filtered bytes not yet returned (in buf)
	buf       []byte
	err       error // the reader's error, returned once out is empty
}

// NewGatewayFilter filters r: advertise is the address the reading side
// reaches the writing side at (the proxy's own), "" to remove the URLs.
func NewGatewayFilter(r io.Reader, advertise string) *GatewayFilter {
	return &GatewayFilter{r: bufio.NewReaderSize(r, 64<<10), advertise: advertise}
}

func (f *GatewayFilter) Read(p []byte) (int, error) {
	for len(f.out) == 0 {
		if f.err != nil {
			return 0, f.err
		}
		if f.payload > 0 {
			n, err := f.r.Read(p[:min(len(p), f.payload)])
			f.payload -= n
			return n, err
		}
		line, err := f.r.ReadSlice('\n')
		switch {
		case err == bufio.ErrBufferFull:
			f.buf = append(f.buf[:0], line...)
			f.midLine, err = true, nil
		case f.midLine || err != nil: // the rest of a long line, or a last partial one
			f.buf = append(f.buf[:0], line...)
			f.midLine = false
		default:
			f.buf = f.filterLine(line)
		}
		f.out = f.buf
		f.err = err
	}
	n := copy(p, f.out)
	f.out = f.out[n:]
	return n, nil
}

// filterLine returns what to pass on for one whole protocol line (in
// f.buf; empty to drop it), and notes the size of a message payload that
// follows.
func (f *GatewayFilter) filterLine(line []byte) []byte {
	fields := bytes.Fields(line)
	if len(fields) == 0 {
		return append(f.buf[:0], line...)
	}
	switch string(bytes.ToUpper(fields[0])) {
	case "INFO":
		if info, keep := f.rewriteInfo(bytes.TrimSpace(line[len("INFO"):])); !keep {
			return f.buf[:0]
		} else if info != nil {
			return append(append(append(f.buf[:0], "INFO "...), info...), "\r\n"...)
		}
	case "MSG", "RMSG", "HMSG", "LMSG", "PUB", "HPUB":
		// The last field is the payload's size (headers included); the
		// payload and its CRLF follow.
		if n, err := strconv.Atoi(string(fields[len(fields)-1])); err == nil && n >= 0 {
			f.payload = n + 2
		}
	}
	return append(f.buf[:0], line...)
}

// rewriteInfo returns the INFO's JSON with its gateway URLs set to
// f.advertise (or removed), nil when it has none to change, and keep false
// for a gossip INFO.
func (f *GatewayFilter) rewriteInfo(arg []byte) (info []byte, keep bool) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(arg, &m); err != nil {
		return nil, true // not ours to judge: the server will reject it
	}
	var cmd int
	if raw, ok := m["gateway_cmd"]; ok && json.Unmarshal(raw, &cmd) == nil && cmd == gatewayCmdGossip {
		return nil, false
	}
	changed := false
	for key, v := range map[string]any{"gateway_urls": []string{f.advertise}, "gateway_url": f.advertise} {
		if _, ok := m[key]; !ok {
			continue
		}
		changed = true
		if f.advertise == "" {
			delete(m, key)
			continue
		}
		b, _ := json.Marshal(v)
		m[key] = b
	}
	if !changed {
		return nil, true
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, true
	}
	return b, true
}
