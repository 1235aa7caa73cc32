package rules

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// waitTimeout bounds every wait for an event; events normally come within a
// few poll intervals.
const waitTimeout = 10 * time.Second

// chanHandler sends log records to a channel.
type chanHandler struct{ ch chan slog.Record }

func (h chanHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h chanHandler) Handle(_ context.Context, r slog.Record) error {
	select {
	case h.ch <- r:
	default:
	}
	return nil
}
func (h chanHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h chanHandler) WithGroup(string) slog.Handler      { return h }

// writeFile replaces path atomically, as editors and Kubernetes do.
func writeFile(tb testing.TB, path, content string) {
	tb.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		tb.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		tb.Fatal(err)
	}
}

func ruleYAML(ids ...string) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString("- id: " + id + "\n  algorithm: token_bucket\n  capacity: 10\n  refill_per_second: 5\n")
	}
	return b.String()
}

type sourceHarness struct {
	src     *FileSource
	path    string
	updates chan []string
	logs    chan slog.Record
	done    chan error
}

func startFileSource(t *testing.T, content string) *sourceHarness {
	t.Helper()
	h := &sourceHarness{
		path:    filepath.Join(t.TempDir(), "rules.yaml"),
		updates: make(chan []string, 16),
		logs:    make(chan slog.Record, 256),
		done:    make(chan error, 1),
	}
	writeFile(t, h.path, content)
	src, err := NewFileSource(h.path, WithPollInterval(5*time.Millisecond), WithLogger(slog.New(chanHandler{h.logs})))
	if err != nil {
		t.Fatal(err)
	}
	h.src = src
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		h.done <- src.Run(ctx, func(rs []Rule) {
			ids := []string{}
			for _, r := range rs {
				ids = append(ids, r.ID)
			}
			h.updates <- ids
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-h.done:
			if err != nil {
				t.Errorf("Run returned %v after cancel, want nil", err)
			}
		case <-time.After(waitTimeout):
			t.Error("Run did not return after cancel")
		}
	})
	return h
}

func (h *sourceHarness) wantUpdate(t *testing.T, ids ...string) {
	t.Helper()
	select {
	case got := <-h.updates:
		if !reflect.DeepEqual(got, ids) {
			t.Fatalf("update %q, want %q", got, ids)
		}
	case err := <-h.done:
		t.Fatalf("Run returned %v, want update %q", err, ids)
	case <-time.After(waitTimeout):
		t.Fatalf("no update %q within %s", ids, waitTimeout)
	}
}

// waitLog waits for an error record whose message contains msg and returns
// its attributes.
func (h *sourceHarness) waitLog(t *testing.T, msg string) map[string]string {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case r := <-h.logs:
			if r.Level != slog.LevelError || !strings.Contains(r.Message, msg) {
				continue
			}
			attrs := map[string]string{}
			r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
			return attrs
		case <-deadline:
			t.Fatalf("no error log %q within %s", msg, waitTimeout)
		}
	}
}

func (h *sourceHarness) wantNoUpdate(t *testing.T) {
	t.Helper()
	select {
	case got := <-h.updates:
		t.Fatalf("unexpected update %q", got)
	default:
	}
}

func TestFileSourceReload(t *testing.T) {
	h := startFileSource(t, ruleYAML("a"))
	h.wantUpdate(t, "a")

	writeFile(t, h.path, ruleYAML("a", "b"))
	h.wantUpdate(t, "a", "b")

	// Invalid: no update, the error is logged naming the field, counted, and
	// the old set stays.
	bad := ruleYAML("a") + "- id: c\n  algorithm: gcra\n  capacity: 1\n  refill_per_second: 1\n"
	writeFile(t, h.path, bad)
	attrs := h.waitLog(t, "rules file invalid")
	if attrs["field"] != "algorithm" || attrs["rule"] != "c" || attrs["item"] != "2" || !strings.Contains(attrs["err"], `unknown algorithm "gcra"`) {
		t.Fatalf("log attributes %v: want field algorithm, rule c, item 2 and the message", attrs)
	}
	h.wantNoUpdate(t) // update would have come before the log
	if got := h.src.Failures(); got != 1 {
		t.Fatalf("Failures = %d, want 1", got)
	}
	if err := h.src.LastError(); !errors.Is(err, ErrUnknownAlgorithm) {
		t.Fatalf("LastError = %v, want ErrUnknownAlgorithm", err)
	}

	// The same bad content rewritten is not a new failure (checked at the
	// end); a comment-only change of a good file is not a new set, so the
	// next update is the next real change.
	writeFile(t, h.path, bad)
	writeFile(t, h.path, ruleYAML("a", "c")+"\n\n")
	h.wantUpdate(t, "a", "c")
	writeFile(t, h.path, "# comment\n"+ruleYAML("a", "c"))
	writeFile(t, h.path, ruleYAML("d"))
	h.wantUpdate(t, "d")
	if err := h.src.LastError(); err != nil {
		t.Fatalf("LastError = %v after a good reload", err)
	}
	if got, want := h.src.Reloads(), uint64(3); got != want {
		t.Fatalf("Reloads = %d, want %d", got, want)
	}
	if got := h.src.Failures(); got != 1 {
		t.Fatalf("Failures = %d, want 1", got)
	}
}

func TestFileSourceRemovedFile(t *testing.T) {
	h := startFileSource(t, ruleYAML("a"))
	h.wantUpdate(t, "a")
	if err := os.Remove(h.path); err != nil {
		t.Fatal(err)
	}
	h.waitLog(t, "rules file unreadable")
	if got := h.src.Failures(); got != 1 {
		t.Fatalf("Failures = %d, want 1", got)
	}
	writeFile(t, h.path, ruleYAML("b"))
	h.wantUpdate(t, "b")
	if got := h.src.Failures(); got != 1 {
		t.Fatalf("Failures = %d after the file came back, want 1 (one outage)", got)
	}
}

func TestFileSourceInitialFailure(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		content *string
		msg     string
	}{
		{"missing file", nil, "no such file"},
		{"unknown algorithm", ptr("- id: a\n  algorithm: gcra\n"), `algorithm: unknown algorithm "gcra"`},
		{"window abc", ptr(`[{"id":"w","algorithm":"fixed_window","limit":1,"window":"abc"}]`), `window: "abc" is not a duration`},
		{"empty file", ptr(""), "empty rules document"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.Repeat("x", i+1)+".yaml")
			if tt.content != nil {
				writeFile(t, path, *tt.content)
			}
			src, err := NewFileSource(path, WithLogger(slog.New(slog.DiscardHandler)))
			if err != nil {
				t.Fatal(err)
			}
			called := false
			err = src.Run(t.Context(), func([]Rule) { called = true })
			if err == nil || !strings.Contains(err.Error(), tt.msg) || called {
				t.Fatalf("Run = %v (update called: %v), want an error containing %q and no update", err, called, tt.msg)
			}
			if src.Failures() != 1 || src.LastError() == nil {
				t.Fatalf("Failures = %d, LastError = %v", src.Failures(), src.LastError())
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

func TestNewFileSourceOptions(t *testing.T) {
	tests := []struct {
		name string
		path string
		opts []FileOption
		msg  string
	}{
		{"empty path", "", nil, "empty rules file path"},
		{"zero interval", "r.yaml", []FileOption{WithPollInterval(0)}, "poll interval"},
		{"nil logger", "r.yaml", []FileOption{WithLogger(nil)}, "nil logger"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewFileSource(tt.path, tt.opts...); err == nil || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("NewFileSource = %v, want an error containing %q", err, tt.msg)
			}
		})
	}
	s, err := NewFileSource("r.yaml")
	if err != nil || s.interval != DefaultPollInterval {
		t.Fatalf("defaults: %v, interval %v", err, s.interval)
	}
}

func TestStaticSource(t *testing.T) {
	t.Run("delivers normalized rules once", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		got := make(chan []Rule, 2)
		done := make(chan error, 1)
		src := StaticSource{tb("a", nil)}
		go func() { done <- src.Run(ctx, func(rs []Rule) { got <- rs }) }()
		select {
		case rs := <-got:
			if len(rs) != 1 || rs[0].Scope != Regional || rs[0].Key[0] != "client_key" {
				t.Fatalf("update %+v, want the normalized rule", rs)
			}
		case <-time.After(waitTimeout):
			t.Fatal("no update")
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run = %v", err)
		}
		if len(got) != 0 {
			t.Fatal("more than one update")
		}
	})
	t.Run("refuses invalid rules", func(t *testing.T) {
		for name, src := range map[string]StaticSource{
			"invalid":      {{ID: "a"}},
			"duplicate id": {tb("a", nil), tb("a", nil)},
		} {
			if err := src.Run(t.Context(), func([]Rule) { t.Error("update called") }); !errors.Is(err, ErrInvalid) {
				t.Errorf("%s: Run = %v, want ErrInvalid", name, err)
			}
		}
	})
}

var _ Source = (*FileSource)(nil)
var _ Source = StaticSource(nil)
