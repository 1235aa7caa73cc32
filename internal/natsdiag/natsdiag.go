// Package natsdiag says why a NATS connection does not connect: the NATS
// client keeps its reconnect errors to itself (it clears LastError at each
// attempt and reports them only to a ReconnectErrHandler given when
// connecting), so a process that did not make the connection learns why by
// dialing the servers itself.
package natsdiag

import (
	"context"
	"net"
	"net/url"

	"github.com/nats-io/nats.go"
)

// Dial tries a TCP connection to each of nc's servers (their URLs as
// nc.Servers gives them: scheme://host:port, never credentials; port 4222
// when none) and returns one line per server: the dial's error, or, for a
// server that accepts the connection, host followed by accepting (what then
// fails: the NATS handshake, TLS, credentials). None when nc has no server.
// ctx bounds the dials.
func Dial(ctx context.Context, nc *nats.Conn, accepting string) []string {
	var out []string
	for _, s := range nc.Servers() {
		u, err := url.Parse(s)
		if err != nil {
			out = append(out, err.Error())
			continue
		}
		host := u.Host
		if u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "4222")
		}
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", host)
		if err != nil {
			out = append(out, err.Error())
			continue
		}
		c.Close()
		out = append(out, host+" "+accepting)
	}
	return out
}
