package agentd

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/apportion/apportion/internal/natsdiag"
	"github.com/apportion/apportion/sync/agent"
	"github.com/nats-io/nats.go"
)

// natsLogEvery is how often the log repeats that NATS is not connected.
const natsLogEvery = 10 * time.Second

// natsDialTimeout bounds the diagnostic dial of natsDown.
const natsDialTimeout = 2 * time.Second

// watchNATS logs the state of nc, the agent's NATS connection (made with
// --nats-url url, retrying forever), until stop is closed: an error naming
// the URL and why it does not connect at once and then every natsLogEvery
// while it is not connected, a warning with the error when it is lost, and
// one line when it is made. The client keeps the dial errors of its
// retries to itself (it calls no handler this process can set after
// connecting), so natsDown dials the servers itself to name the error.
func watchNATS(stop <-chan struct{}, nc *nats.Conn, urls string, log *slog.Logger) {
	var mu sync.Mutex
	var lost error // why the connection was lost last
	nc.SetDisconnectErrHandler(func(_ *nats.Conn, err error) {
		if nc.IsClosed() {
			return // shutting down
		}
		mu.Lock()
		lost = err
		mu.Unlock()
		log.Warn("NATS connection lost; reconnecting (reports neither sent nor received meanwhile)", "url", agent.RedactURLs(nc.Servers()), "err", err)
	})
	connected, logged := false, time.Time{}
	check := func() {
		switch {
		case nc.IsConnected():
			if !connected {
				log.Info("NATS connected", "url", agent.RedactURLs([]string{nc.ConnectedUrlRedacted()}), "max_payload", nc.MaxPayload())
			}
			connected, logged = true, time.Time{}
		case nc.IsClosed():
			if !logged.IsZero() {
				return
			}
			log.Error("NATS connection closed", "url", agent.RedactURLs(strings.Split(urls, ",")), "err", nc.LastError())
			logged = time.Now()
		default:
			connected = false
			if !logged.IsZero() && time.Since(logged) < natsLogEvery {
				return
			}
			logged = time.Now()
			mu.Lock()
			why := lost
			mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), natsDialTimeout)
			err := natsDown(ctx, nc, why)
			cancel()
			log.Error("cannot connect to NATS (--nats-url): no report is sent or received and /readyz answers 503 until it connects; retrying",
				"url", agent.RedactURLs(strings.Split(urls, ",")), "status", nc.Status().String(), "err", err)
		}
	}
	check()
	tk := time.NewTicker(250 * time.Millisecond)
	defer tk.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tk.C:
			check()
		}
	}
}

// natsDown says why nc does not connect: the connection's last error or
// lost (why it was lost last), else the error of a TCP dial to each of its
// servers (a server that accepts one, the NATS handshake fails: TLS or
// credentials).
func natsDown(ctx context.Context, nc *nats.Conn, lost error) error {
	if err := nc.LastError(); err != nil {
		return err
	}
	errs := natsdiag.Dial(ctx, nc, "accepts TCP connections but the NATS handshake fails (TLS: --nats-ca; credentials: --nats-creds, --nats-nkey; see the server's log)")
	if lost != nil {
		errs = append(errs, "the connection was lost: "+lost.Error())
	}
	if len(errs) == 0 {
		return errors.New("no server to connect to")
	}
	return errors.New(strings.Join(errs, "; "))
}
