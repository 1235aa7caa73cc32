package serve

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// startHTTP serves h with timeouts t on loopback until the test ends.
func startHTTP(t *testing.T, h http.Handler, to Timeouts) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := NewHTTP(h, to, nil, nil)
	done := make(chan error, 1)
	go func() { done <- HTTP(s, l) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; err != nil {
			t.Errorf("HTTP: %v", err)
		}
	})
	return l.Addr().String()
}

// cutOffAfter writes head, then one byte of trickle every 50 ms, and
// returns how long the server took to close the connection.
func cutOffAfter(t *testing.T, addr, head, trickle string) time.Duration {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	io.WriteString(c, head)
	closed := make(chan struct{})
	go func() {
		// Until the server closes: it may answer first (408/400), then close.
		io.Copy(io.Discard, c)
		close(closed)
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-closed:
			return time.Since(start)
		case <-tick.C:
			if i < len(trickle) {
				c.Write([]byte{trickle[i]}) // errors once closed: the read side reports it
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("the server still holds the connection after %v", time.Since(start))
		}
	}
}

func TestSlowClientsAreCutOff(t *testing.T) {
	bodyRead := make(chan error, 10)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		bodyRead <- err
		if err != nil {
			http.Error(w, "slow body", http.StatusRequestTimeout)
			return
		}
		io.WriteString(w, "ok")
	})
	to := Timeouts{ReadHeader: 300 * time.Millisecond, Read: 600 * time.Millisecond, Write: 5 * time.Second, Idle: 400 * time.Millisecond}
	addr := startHTTP(t, h, to)
	// The slack absorbs a loaded machine; the trickles below would take
	// 10 s and more to finish.
	const slack = 3 * time.Second

	t.Run("slow body", func(t *testing.T) {
		d := cutOffAfter(t, addr, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n", strings.Repeat("b", 200))
		t.Logf("a body sent at 20 bytes/s was cut off after %v (read timeout %v)", d, to.Read)
		if d < to.Read/2 || d > to.Read+slack {
			t.Fatalf("cut off after %v, want about the read timeout %v", d, to.Read)
		}
		if err := <-bodyRead; err == nil {
			t.Fatal("the handler read the whole slow body")
		}
	})
	t.Run("slow headers", func(t *testing.T) {
		d := cutOffAfter(t, addr, "GET / HTTP/1.1\r\n", strings.Repeat("X-Slow: 1\r\n", 40))
		t.Logf("headers sent at 20 bytes/s were cut off after %v (read-header timeout %v)", d, to.ReadHeader)
		if d < to.ReadHeader/2 || d > to.ReadHeader+slack {
			t.Fatalf("cut off after %v, want about the read-header timeout %v", d, to.ReadHeader)
		}
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nb")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		<-bodyRead
		start := time.Now()
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := br.ReadByte(); err == nil {
			t.Fatal("the server sent more on an idle connection")
		}
		d := time.Since(start)
		t.Logf("an idle keep-alive connection was closed after %v (idle timeout %v)", d, to.Idle)
		if d > to.Idle+slack {
			t.Fatalf("idle connection closed after %v, want about %v", d, to.Idle)
		}
	})
	t.Run("a normal request is served", func(t *testing.T) {
		resp, err := http.Post("http://"+addr+"/", "text/plain", strings.NewReader("hello"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 || string(b) != "ok" {
			t.Fatalf("%d %q", resp.StatusCode, b)
		}
		<-bodyRead
	})
}

func TestNewHTTPDefaults(t *testing.T) {
	s := NewHTTP(http.NotFoundHandler(), Timeouts{Read: time.Second}, nil, nil)
	if s.ReadHeaderTimeout != DefaultReadHeaderTimeout || s.ReadTimeout != time.Second ||
		s.WriteTimeout != DefaultWriteTimeout || s.IdleTimeout != DefaultIdleTimeout {
		t.Fatalf("timeouts %v %v %v %v", s.ReadHeaderTimeout, s.ReadTimeout, s.WriteTimeout, s.IdleTimeout)
	}
}

func TestFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key"},
		{[]string{"--tls-client-ca", "ca.pem"}, "--tls-client-ca needs --tls-cert"},
		{[]string{"--http-read-timeout", "0s"}, "must be positive"},
		{[]string{"--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"}, "server certificate"},
	} {
		t.Run(fmt.Sprint(tc.args), func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			var tl TLS
			to := DefaultTimeouts()
			tl.Register(fs, "the ports")
			to.Register(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := to.Validate()
			if err == nil {
				_, err = tl.Server(nil)
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
