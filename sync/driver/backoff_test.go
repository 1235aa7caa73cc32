package driver

import (
	"testing"
	"time"
)

func TestBackoffs(t *testing.T) {
	var b time.Duration
	var got []time.Duration
	for range 8 {
		b = StartBackoff(b)
		got = append(got, b)
	}
	want := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, 1600 * time.Millisecond, 3200 * time.Millisecond, 6400 * time.Millisecond, 10 * time.Second, 10 * time.Second}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("StartBackoff sequence %v, want %v", got, want)
		}
	}
	for fails, w := range []time.Duration{500, 1000, 2000, 2000, 2000} {
		if g := PollWait(500, fails); g != w {
			t.Errorf("PollWait(500, %d) = %v, want %v", fails, g, w)
		}
	}
}
