package main

import (
	"context"
	"io"
	"strings"
	"testing"
)

// TestRedisAddrRefused: a --redis-addr go-redis cannot dial stops the agent
// at start, naming the flag and the entry (command.Main prints it and exits
// 1), instead of an agent whose every Redis call fails.
func TestRedisAddrRefused(t *testing.T) {
	for addr, want := range map[string]string{
		"bogus":    `--redis-addr: want HOST:PORT or unix:///PATH, got "bogus": missing port in address`,
		"a:1,,b:2": `--redis-addr: want HOST:PORT or unix:///PATH, got a blank entry in "a:1,,b:2"`,
	} {
		err := run(context.Background(), []string{"--region", "a", "--etcd-endpoints", "http://127.0.0.1:1", "--redis-addr", addr}, io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("--redis-addr %q: %v, want an error containing %q", addr, err, want)
		}
	}
}
