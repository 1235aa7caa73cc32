package launch

import (
	"fmt"
	"net"
	"time"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("launch: free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// retry runs start up to attempts times and returns the first success or the
// last error. Ports are picked free and then bound, so another process can
// take one in between; a fresh attempt picks new ports.
func retry[T any](attempts int, start func() (T, error)) (T, error) {
	var (
		v   T
		err error
	)
	for i := 0; i < attempts; i++ {
		if v, err = start(); err == nil {
			return v, nil
		}
	}
	return v, err
}

// again runs start up to attempts times, pause apart, until it succeeds: a
// server restarting on its old port may find it held for a moment by the
// listener it just closed.
func again(attempts int, pause time.Duration, start func() error) error {
	var err error
	for i := 0; i < attempts; i++ {
		if err = start(); err == nil {
			return nil
		}
		time.Sleep(pause)
	}
	return err
}
